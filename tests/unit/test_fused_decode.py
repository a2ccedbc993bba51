"""Fused multi-adapter decoding: each request samples as HF ``generate`` would, alone or in any gang."""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _numerics import FLOAT32_EPS, rounding_bound
from helpers import small_llama_config
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    GenerationConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from optuna_rapidfire._fused import _fused_decode, _launched_decode, _workspace
from optuna_rapidfire._fused._fused_decode import DecodeRequest, Sampling, decode, penalize, warp
from optuna_rapidfire._fused._fused_pass import named_lora_layers

PAD = 0
VOCAB = 64  # small, so that a random model's rows reach their EOS within a few tokens
# Mixed ranks and target modules, as trials of one study would have; t0's dropout must not apply.
ADAPTERS = {
    "t0": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1},
    "t1": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
    "t2": {"r": 4, "lora_alpha": 8, "target_modules": ["o_proj", "down_proj"]},
}


@pytest.fixture(scope="module")
def model() -> Iterator[PeftModel]:
    """A 2-layer Llama (random weights, grouped-query attention) with the ADAPTERS, their B non-zero."""
    torch.manual_seed(0)
    config = small_llama_config(
        vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.2, pad_token_id=PAD, eos_token_id=None
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft: Any = None
        for name, settings in ADAPTERS.items():
            lora = LoraConfig(**settings)  # type: ignore[arg-type]
            if peft is None:
                peft = get_peft_model(LlamaForCausalLM(config), lora, adapter_name=name)
            else:
                peft.add_adapter(name, lora)
    for param_name, param in peft.named_parameters():
        if "lora_B" in param_name:
            torch.nn.init.normal_(param, std=0.5)
    peft.eval()
    yield peft


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hf_generate(
    model: PeftModel, adapter: str, prompts: list[list[int]], seed: int, pad: int = PAD, **settings: Any
) -> list[list[int]]:
    """HF ``generate`` with ``adapter`` active on the left-padded prompts, each completion cut as TRL's
    ``GRPOTrainer._generate_single_turn`` cuts it (after its first EOS, EOS kept)."""
    model.set_adapter(adapter)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    config = GenerationConfig(pad_token_id=pad, **settings)
    completion_ids = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, width:]
    is_eos = torch.isin(completion_ids, torch.tensor(settings.get("eos_token_id", []), dtype=torch.long))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    completion_mask = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)
    return [c[m].tolist() for c, m in zip(completion_ids, completion_mask, strict=True)]


def _an_eos(model: PeftModel, request: DecodeRequest) -> int:
    """A token the request generates at its first row's fourth step (so that row ends early)."""
    return decode(model, [request], PAD)[0][0][3]


@pytest.mark.numerics
@pytest.mark.parametrize("launched", [True, False], ids=["launched", "hf-forward"])
def test_greedy_decoding_equals_hf_generate_with_the_adapter_active(model: PeftModel, launched: bool) -> None:
    prompts = _prompts(1, [3, 7, 5])
    eos = _an_eos(model, DecodeRequest("t1", prompts, 10, do_sample=False))
    ours = decode(
        model, [DecodeRequest("t1", prompts, 10, do_sample=False, eos_token_ids=(eos,))], PAD, launched=launched
    )[0]
    theirs = _hf_generate(model, "t1", prompts, 0, max_new_tokens=10, do_sample=False, eos_token_id=[eos])
    assert ours == theirs
    assert len(ours[0]) <= 4 and ours[0][-1] == eos and any(len(row) == 10 for row in ours)


@pytest.mark.numerics
@pytest.mark.parametrize("launched", [True, False], ids=["launched", "hf-forward"])
def test_sampling_alone_draws_the_tokens_of_hf_generate_seeded_like_the_global_rng(
    model: PeftModel, launched: bool
) -> None:
    """The exponential race is torch.multinomial's: with the same seed, HF's own tokens."""
    prompts = _prompts(2, [4, 6, 2, 6])
    settings = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3}
    eos = _an_eos(model, DecodeRequest("t0", prompts, 12, do_sample=False))
    request = DecodeRequest("t0", prompts, 12, generator=_generator(7), eos_token_ids=(eos,), **settings)  # type: ignore[arg-type]
    ours = decode(model, [request], PAD, launched=launched)[0]
    theirs = _hf_generate(model, "t0", prompts, 7, max_new_tokens=12, do_sample=True, eos_token_id=[eos], **settings)
    assert ours == theirs
    assert len({tuple(row) for row in ours}) == len(ours)  # not a degenerate distribution


@pytest.mark.numerics
@pytest.mark.parametrize("launched", [True, False], ids=["launched", "hf-forward"])
def test_the_repetition_penalty_leaves_the_left_padding_alone_as_hf_does(model: PeftModel, launched: bool) -> None:
    """Padding with the token a padded row picks first: penalized, the padding would change that pick."""
    prompts = _prompts(8, [2, 9])
    first = decode(model, [DecodeRequest("t1", prompts, 1, do_sample=False)], PAD)[0][0][0]
    assert first not in prompts[0]
    request = DecodeRequest("t1", prompts, 6, do_sample=False, repetition_penalty=5.0)
    ours = decode(model, [request], first, launched=launched)[0]
    theirs = _hf_generate(model, "t1", prompts, 0, pad=first, max_new_tokens=6, do_sample=False, repetition_penalty=5.0)
    assert ours == theirs and ours[0][0] == first


def _gang_requests(seed: int = 0) -> list[DecodeRequest]:
    """Different adapters, settings, row counts and max_new_tokens; fresh generators from ``seed``."""
    return [
        DecodeRequest("t0", _prompts(3, [5, 2, 8]), 7, temperature=0.8, top_k=10, generator=_generator(seed + 1)),
        DecodeRequest("t1", _prompts(4, [3, 6]), 12, top_p=0.8, repetition_penalty=1.2, generator=_generator(seed + 2)),
        DecodeRequest("t2", _prompts(5, [4, 4, 7, 1]), 4, temperature=1.3, min_p=0.1, generator=_generator(seed + 3)),
    ]


def _layouts(model: PeftModel, requests: list[DecodeRequest], launched: bool) -> list[list[int]]:
    """The batch's layouts through a decode of ``requests``: per layout, the rows of each request present
    (HF forward), or the requests in the slots (launched)."""
    lm = model.get_base_model()
    with torch.no_grad():
        if launched:
            run: Any = _launched_decode.LaunchedDecode(model, lm, requests, PAD, torch.device("cpu"))
        else:
            run = _fused_decode._Decode(model, lm, requests, PAD, torch.device("cpu"))
        run.run()
    return run.layouts


@pytest.mark.numerics
@pytest.mark.parametrize("launched", [True, False], ids=["launched", "hf-forward"])
def test_a_request_samples_the_same_completions_alone_and_in_any_gang(model: PeftModel, launched: bool) -> None:
    """Ended rows (HF forward) or ended requests (launched) leave the batch without changing the others' tokens."""
    alone = [decode(model, [request], PAD, launched=launched)[0] for request in _gang_requests()]
    model.train()  # decode runs in eval mode (t0's dropout off) and gives the mode back
    together = decode(model, _gang_requests(), PAD, launched=launched)
    assert model.training and all(m.training for m in model.modules())
    model.eval()
    assert together == alone
    layouts = _layouts(model, _gang_requests(), launched)
    if launched:  # t2 (4 tokens) and t0 (7) have ended at the first check (8 steps); t1 goes on to 12
        assert layouts == [[0, 1, 2], [1]]
    else:  # t2 (4 tokens), then t0 (7) left; t1 goes on to 12
        assert layouts[0] == [3, 2, 4] and layouts[-1] == [2]
    reordered = decode(model, [_gang_requests()[2], _gang_requests()[0]], PAD, launched=launched)
    assert reordered == [alone[2], alone[0]]


def test_different_adapters_sample_different_completions_from_the_same_prompts_and_seed(model: PeftModel) -> None:
    prompts = _prompts(6, [4, 4])
    completions = [
        decode(model, [DecodeRequest(name, prompts, 8, generator=_generator(0))], PAD)[0] for name in ADAPTERS
    ]
    assert completions[0] != completions[1] != completions[2] != completions[0]


def test_each_request_stops_at_its_max_new_tokens_and_each_row_at_its_first_eos(model: PeftModel) -> None:
    """With EOS, every row is its completion without EOS cut after the first EOS; the rest is unchanged."""
    free = decode(model, _gang_requests(), PAD)
    for request, rows in zip(_gang_requests(), free, strict=True):
        assert [len(row) for row in rows] == [request.max_new_tokens] * len(request.prompts)
    eos = (free[1][0][2], free[2][1][1])
    stopped = decode(model, [DecodeRequest(**{**vars(r), "eos_token_ids": eos}) for r in _gang_requests()], PAD)
    cut = 0
    for rows, rows_free in zip(stopped, free, strict=True):
        for row, row_free in zip(rows, rows_free, strict=True):
            first = next((i for i, token in enumerate(row_free) if token in eos), None)
            assert row == (row_free if first is None else row_free[: first + 1])
            cut += first is not None and first + 1 < len(row_free)
    assert cut >= 2


def test_top_k_1_sampling_equals_greedy(model: PeftModel) -> None:
    prompts = _prompts(7, [2, 5, 9])
    greedy = decode(model, [DecodeRequest("t2", prompts, 9, do_sample=False, repetition_penalty=1.4)], PAD)
    top_1 = decode(
        model,
        [DecodeRequest("t2", prompts, 9, temperature=0.6, top_k=1, repetition_penalty=1.4, generator=_generator(3))],
        PAD,
    )
    assert top_1 == greedy


# (request settings, do_sample): every processor alone and together, edge values included.
PROCESSED = [
    {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3},
    {"temperature": 1.5, "top_p": 0.5},
    {"top_k": 5},
    {"top_k": 5000},  # more than the vocabulary: nothing removed
    {"temperature": 0.5, "min_p": 0.2},
    {"top_p": 0.0},  # only the most likely token stays
    {"repetition_penalty": 0.8, "top_p": 0.95},
    {},
    {"do_sample": False, "repetition_penalty": 1.5},
]


def _hf_processors(settings: dict[str, Any]) -> LogitsProcessorList:
    """HF's processors for these settings, in the order ``GenerationMixin._get_logits_processor`` adds them."""
    processors = LogitsProcessorList()
    if settings.get("repetition_penalty", 1.0) != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]))
    if not settings.get("do_sample", True):
        return processors
    if settings.get("temperature", 1.0) != 1.0:
        processors.append(TemperatureLogitsWarper(settings["temperature"]))
    if settings.get("top_k"):
        processors.append(TopKLogitsWarper(settings["top_k"]))
    if settings.get("top_p", 1.0) < 1.0:
        processors.append(TopPLogitsWarper(settings["top_p"]))
    if settings.get("min_p") is not None:
        processors.append(MinPLogitsWarper(settings["min_p"]))
    return processors


@pytest.mark.numerics
def test_processing_a_batch_equals_hf_logits_processors_row_by_row() -> None:
    """Kept tokens exactly; their log-probabilities within the rounding of a log-sum-exp over the vocabulary
    (plus a few ulps of the values themselves, which reach about 20 here)."""
    vocab = 1000
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PROCESSED), vocab, generator=generator) * 3  # no near-ties
    ids = torch.randint(0, vocab, (len(PROCESSED), 30), generator=generator)
    requests = [DecodeRequest(f"r{i}", [[1]], 1, **s) for i, s in enumerate(PROCESSED)]
    seen = torch.zeros(len(PROCESSED), vocab, dtype=torch.bool).scatter_(1, ids, True)
    sampling = Sampling.of(requests, vocab, torch.device("cpu"))
    scores = penalize(logits, seen, sampling.penalty)
    warped = warp(scores, sampling, top_k=True, top_p=True, min_p=True)
    tolerance = rounding_bound(vocab) + 20 * 4 * FLOAT32_EPS
    for i, settings in enumerate(PROCESSED):
        theirs = _hf_processors(settings)(ids[i : i + 1], logits[i : i + 1].clone())[0]
        ours = warped[i] if settings.get("do_sample", True) else scores[i]
        kept = torch.isfinite(theirs)
        assert torch.equal(torch.isfinite(ours), kept), settings
        filters = settings.get("do_sample", True) and (
            "top_p" in settings or "min_p" in settings or settings.get("top_k", vocab) < vocab
        )
        assert kept.any() and bool(kept.sum() < vocab) == filters, settings
        if not settings.get("do_sample", True):
            torch.testing.assert_close(ours, theirs, rtol=2 * FLOAT32_EPS, atol=0)
            continue
        difference = (ours.log_softmax(-1)[kept] - theirs.log_softmax(-1)[kept]).abs().max()
        assert difference <= tolerance, (settings, float(difference))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prompts": []}, "prompts=[]"),
        ({"prompts": [[1], []]}, "prompts [1] are empty"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"top_k": -1}, "top_k=-1"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"min_p": -0.1}, "min_p=-0.1"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0"),
    ],
)
def test_a_bad_request_raises_naming_the_value(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        DecodeRequest(**{"adapter": "t0", "prompts": [[1, 2]], "max_new_tokens": 4, **settings})


def test_greedy_requests_ignore_sampling_settings() -> None:
    DecodeRequest("t0", [[1]], 4, do_sample=False, temperature=0.0, top_p=2.0)


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([], "requests=[]"),
        ([DecodeRequest("nope", [[1]], 4)], "no adapter 'nope'"),
        ([DecodeRequest("t0", [[1]], 4), DecodeRequest("t0", [[2]], 4)], "['t0', 't0']"),
    ],
)
def test_bad_requests_raise_naming_the_value_before_any_work(
    model: PeftModel, requests: list[DecodeRequest], message: str
) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decode did work before validating")

    hook = model.get_base_model().get_input_embeddings().register_forward_pre_hook(forbidden)
    model.train()
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            decode(model, requests, PAD)
    finally:
        hook.remove()
    assert model.training
    model.eval()


def test_the_lora_injected_base_decodes_as_its_peft_model(model: PeftModel) -> None:
    def requests() -> list[DecodeRequest]:
        return [DecodeRequest("t0", _prompts(9, [3, 5]), 6, generator=_generator(1))]

    assert decode(model.get_base_model(), requests(), PAD) == decode(model, requests(), PAD)


def test_a_decoder_the_launched_decode_does_not_know_decodes_through_the_hf_forward() -> None:
    """GPT-2's layout (no rotary embedding, fused attention projections) is refused by name with
    ``launched=True`` before any work, and decodes through the HF forward by default."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt2 = get_peft_model(GPT2LMHeadModel(config), LoraConfig(r=2, target_modules=["c_attn"]), adapter_name="g")
    assert "Llama-layout" in (_workspace.supports(gpt2.get_base_model()) or "")
    request = DecodeRequest("g", _prompts(10, [3, 5]), 4, do_sample=False)
    with pytest.raises(ValueError, match="launched decode cannot run this model: GPT2LMHeadModel"):
        decode(gpt2, [request], PAD, launched=True)
    assert decode(gpt2, [request], PAD) == decode(gpt2, [request], PAD, launched=False)
    assert all(len(row) == 4 for row in decode(gpt2, [request], PAD)[0])


@pytest.mark.numerics
def test_a_prompt_repeated_per_generation_is_prefilled_once_and_its_rows_sample_apart(model: PeftModel) -> None:
    """GRPO's rows repeat each prompt once per generation: the launched prefill runs each slot's distinct
    prompts once, and every row samples its own tokens, as through the HF forward."""
    prompts = [p for p in _prompts(11, [4, 7]) for _ in range(3)]

    def requests() -> list[DecodeRequest]:
        return [
            DecodeRequest("t1", prompts, 9, temperature=0.9, generator=_generator(5)),
            DecodeRequest("t2", prompts[:3], 6, generator=_generator(6)),
        ]

    run = _launched_decode.LaunchedDecode(model, model.get_base_model(), requests(), PAD, torch.device("cpu"))
    with torch.no_grad():
        launched = run.run()
    assert run.prefilled == [(3, 7)]  # one pass (short prompts): t1's 2 distinct prompts and t2's 1, 7 wide
    assert launched == decode(model, requests(), PAD, launched=False)
    assert len({tuple(row) for row in launched[0]}) > 2  # rows of one prompt sample apart


@pytest.mark.numerics
def test_prompts_packed_by_length_decode_as_one_padded_prefill(
    model: PeftModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With passes free (no cost per pass), each prompt length of the gang gets its own prefill pass, mixing
    slots (each row through its own adapter), each pass only as wide as its prompts; the completions are those
    of one pass padded to the widest prompt and those of the HF forward."""
    prompts = _prompts(12, [3, 9, 3, 5])

    def requests() -> list[DecodeRequest]:
        return [
            DecodeRequest("t1", [p for p in prompts for _ in range(2)], 7, temperature=0.8, generator=_generator(1)),
            DecodeRequest("t0", prompts[2:], 7, generator=_generator(2)),
            DecodeRequest("t2", prompts[:1], 7, do_sample=False),
        ]

    lm = model.get_base_model()
    one = _launched_decode.LaunchedDecode(model, lm, requests(), PAD, torch.device("cpu"))
    with torch.no_grad():
        padded = one.run()
    assert one.prefilled == [(7, 9)]  # t1: 4 distinct prompts, t0: 2, t2: 1, all padded to 9
    monkeypatch.setattr(_launched_decode, "_BUCKET_TOKENS", 0)
    packed = _launched_decode.LaunchedDecode(model, lm, requests(), PAD, torch.device("cpu"))
    with torch.no_grad():
        assert packed.run() == padded
    assert packed.prefilled == [(4, 3), (2, 5), (1, 9)]  # lengths 3 (t1, t0 and t2's), 5 and 9
    assert padded == decode(model, requests(), PAD, launched=False)


@pytest.mark.parametrize("seed", range(20))
def test_length_buckets_take_the_fewest_tokens_of_any_cut_of_the_sorted_prompts(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator).tolist()
    pass_tokens = int(torch.randint(0, 80, (1,), generator=generator))
    runs = _launched_decode.length_buckets(lengths, pass_tokens)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    widths = [max(lengths[i] for i in run) for run in runs]
    assert widths == sorted(widths) and all(  # runs of the sorted order: no prompt is longer than the next run's
        max(lengths[i] for i in run) <= min(lengths[i] for i in after) for run, after in itertools.pairwise(runs)
    )

    def cost(runs: list[list[int]]) -> int:
        return sum(len(run) * max(lengths[i] for i in run) + pass_tokens for run in runs)

    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    fewest = min(  # every cut of the sorted prompts into runs
        cost([order[a:b] for a, b in itertools.pairwise([0, *cuts, len(order)])])
        for k in range(len(order))
        for cuts in itertools.combinations(range(1, len(order)), k)
    )
    assert cost(runs) == fewest


def test_length_buckets_cut_where_a_pass_saves_more_padding_than_it_costs() -> None:
    assert _launched_decode.length_buckets([100, 10, 100, 12], 50) == [[1, 3], [0, 2]]  # saves 2 x 88 > 50
    assert _launched_decode.length_buckets([100, 10, 100, 12], 200) == [[1, 3, 0, 2]]  # one pass: 176 < 200
    assert _launched_decode.length_buckets([7, 7, 7], 0) == [[0, 1, 2]]
    assert _launched_decode.length_buckets([], 10) == []


def _decode_of_width(model: PeftModel, width: int) -> list[list[list[int]]]:
    """A greedy decode whose prompts are ``width`` wide: ``width`` > 250 needs a workspace of 512 columns."""
    prompts = _prompts(13, [width, 3])
    return decode(model, [DecodeRequest("t1", prompts, 4, do_sample=False)], PAD, launched=True)


def test_kept_workspaces_stay_within_their_count_and_memory(model: PeftModel, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = _workspace._WORKSPACES
    monkeypatch.setattr(_workspace, "_WORKSPACES", type(kept)())
    narrow, wide = _decode_of_width(model, 5), _decode_of_width(model, 300)
    assert [shape.columns for shape in _workspace._WORKSPACES[model]] == [256, 512]  # both kept, latest last
    assert _decode_of_width(model, 5) == narrow  # reused: moved to the end
    assert [shape.columns for shape in _workspace._WORKSPACES[model]] == [512, 256]
    spaces = list(_workspace._WORKSPACES[model].values())
    cache = 2 * 2 * 2 * 2 * 256 * 8 * 4  # K and V of 2 layers: 2 rows x 2 heads x 256 columns x 8 dims, float32
    assert spaces[0].nbytes > spaces[1].nbytes > cache
    monkeypatch.setattr(_workspace, "_CPU_KEPT_BYTES", spaces[0].nbytes - 1)  # the idle 512-column one no longer fits
    assert _decode_of_width(model, 6) == _decode_of_width(model, 6)
    assert [shape.columns for shape in _workspace._WORKSPACES[model]] == [256]
    assert _decode_of_width(model, 300) == wide  # made again; the idle 256-column one is small enough to stay
    assert [shape.columns for shape in _workspace._WORKSPACES[model]] == [256, 512]
    monkeypatch.setattr(_workspace, "_KEPT", 1)
    _decode_of_width(model, 5)
    assert [shape.columns for shape in _workspace._WORKSPACES[model]] == [256]


def test_a_workspace_that_does_not_fit_drops_the_kept_ones_and_is_made_again(
    model: PeftModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of memory making a new workspace: the kept ones go and the allocation is tried once more; when
    it fails again (or nothing was kept), the decode raises the error."""
    monkeypatch.setattr(_workspace, "_WORKSPACES", type(_workspace._WORKSPACES)())
    narrow = _decode_of_width(model, 5)
    wide = _decode_of_width(model, 300)
    monkeypatch.setattr(_workspace, "_WORKSPACES", type(_workspace._WORKSPACES)())
    made = _workspace.Workspace
    failures = [1]

    def short_of_memory(*args: Any) -> _workspace.Workspace:
        if failures[0]:
            failures[0] -= 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return made(*args)

    assert _decode_of_width(model, 5) == narrow
    monkeypatch.setattr(_workspace, "Workspace", short_of_memory)
    with caplog.at_level("WARNING", logger="optuna_rapidfire"):
        assert _decode_of_width(model, 300) == wide
    assert "did not fit" in caplog.text and "dropped the 1 kept" in caplog.text
    assert [shape.columns for shape in _workspace._WORKSPACES[model]] == [512]
    failures[0] = 2  # fails again after the kept ones went: raised
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _decode_of_width(model, 5)
    monkeypatch.setattr(_workspace, "_WORKSPACES", type(_workspace._WORKSPACES)())
    failures[0] = 1  # nothing kept to drop: raised at once
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _decode_of_width(model, 5)


def test_the_callers_layers_spare_the_walk_and_still_name_a_missing_adapter(
    model: PeftModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    layers = named_lora_layers(model)
    expected = decode(model, [DecodeRequest("t0", _prompts(3, [4, 6]), 5, generator=_generator(2))], PAD)

    def walked(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("decode walked the model for its LoRA layers")

    monkeypatch.setattr(_fused_decode, "lora_layers", walked)
    request = DecodeRequest("t0", _prompts(3, [4, 6]), 5, generator=_generator(2))
    assert decode(model, [request], PAD, layers=layers) == expected
    with pytest.raises(ValueError, match=re.escape("no adapter 'nope'")):
        decode(model, [DecodeRequest("nope", [[1]], 4)], PAD, layers=layers)


def test_a_kept_workspace_loads_adapters_changed_in_place_or_rebuilt_under_their_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A workspace reuses what it found to load a gang's adapters while they are the same modules: an in-place
    update (an optimizer step) reaches the next decode, and an adapter deleted and made again under its name
    (another rank) is found again; each decode equals one through a new workspace."""
    monkeypatch.setattr(_workspace, "_WORKSPACES", type(_workspace._WORKSPACES)())
    torch.manual_seed(1)
    config = small_llama_config(vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=PAD, eos_token_id=None)
    peft: Any = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"), "a")
    peft.add_adapter("b", LoraConfig(r=8, target_modules="all-linear"))

    def lora_b(adapter: str) -> list[torch.nn.Parameter]:
        return [p for name, p in peft.named_parameters() if f"lora_B.{adapter}." in name]

    with torch.no_grad():
        for param in lora_b("a") + lora_b("b"):
            param.normal_(std=0.5)
    peft.eval()

    def gang() -> list[list[list[int]]]:
        requests = [
            DecodeRequest(name, _prompts(seed, [5, 3]), 6, generator=_generator(seed))
            for seed, name in ((7, "a"), (8, "b"))
        ]
        return decode(peft, requests, PAD)

    def fresh() -> list[list[list[int]]]:
        _workspace._WORKSPACES.clear()
        return gang()

    first = gang()
    assert gang() == first == fresh()
    with torch.no_grad():
        for param in lora_b("a"):
            param.add_(1.0)
    updated = gang()
    assert updated[0] != first[0] and updated[1] == first[1]
    assert updated == fresh()
    gang()  # the workspace kept again, holding the updated adapters
    peft.delete_adapter("a")
    peft.add_adapter("a", LoraConfig(r=2, target_modules="all-linear"))
    with torch.no_grad():
        for param in lora_b("a"):
            param.normal_(std=0.5)
    rebuilt = gang()
    assert rebuilt[0] != updated[0] and rebuilt == fresh()
