"""Where GRPO trials' completions come from: one decode batch, each row through its own trial's adapter.

TRL's ``GRPOTrainer`` generates inside its training step and its evaluation, with ``model.generate`` and
the process's global RNG. Here every GRPO trial's trainer generates through :class:`Generation` instead:
the prompts it would generate for (tokenized by TRL, repeated per generation) become a
:class:`~optuna_rapidfire._fused._fused_decode.DecodeRequest` with the trial's own sampling settings
(those of the ``GenerationConfig`` TRL built from its ``GRPOConfig``) and its own generator (seeded from
the trial's ``seed``, its state saved with the trial's state, checkpoints and clones), and
:func:`~optuna_rapidfire._fused._fused_decode.decode` samples them. A trial trained alone decodes alone.
The members of a fused gang train their chunks in :class:`~optuna_rapidfire._trainers.grpo._turns.Turns`: each
runs its own TRL step until it generates, and the members waiting then decode together, in one batch.
A trial's completions depend only on its adapter, its settings and its generator, not on its gang. In
such a gang the members' policy steps also share their forward and backward passes
(:mod:`optuna_rapidfire._trainers.grpo._policy_pass`): the grad-enabled log-probabilities and the backward of
each member's TRL loss are routed here, and the members waiting for them meet the same way.

What this decode does not do (images, beam search and other generation options, see :func:`refusal`)
generates as TRL does, alone, and the log says why once.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from optuna_rapidfire import _compat, events
from optuna_rapidfire._fused._fused_decode import DecodeRequest, decode
from optuna_rapidfire._fused._fused_pass import pad_token_id
from optuna_rapidfire._logging import get_logger
from optuna_rapidfire._resident._state import RngState
from optuna_rapidfire._trainers.grpo._policy_pass import BackwardRequest, LogpsRequest, PolicyPasses
from optuna_rapidfire._trainers.grpo._rewards import RewardRequest, shared_rewards
from optuna_rapidfire._trainers.grpo._rewards import refusal as rewards_refusal
from optuna_rapidfire._trainers.grpo._turns import Turns, each_alone_after_failure

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from optuna_rapidfire._trainers._host import GangHost, Member

_logger = get_logger(__name__)

M = TypeVar("M", bound="Member")
R = TypeVar("R")

_SEED_OFFSET = 0x5A3B
"""Added to a trial's ``seed`` for its sampling generator (so its draws differ from its dropout's)."""

# The GenerationConfig fields TRL's GRPOTrainer sets, which the decode honours (GRPOConfig.generation_kwargs
# may add any other field of GenerationConfig: those trials generate as TRL does).
_COVERED = {
    "max_new_tokens",
    "do_sample",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "cache_implementation",
}

Completions = list[list[int]]

_LATER: Any = object()
"""A shared step's answer to a member of a later phase than the members it served: ask again."""


def _phase(request: Any) -> int:
    """Where a request comes in a GRPO step: decode, old policy's score, reference, rewards, evaluation's score,
    policy's score, backward."""
    if isinstance(request, DecodeRequest):
        return 0
    if isinstance(request, RewardRequest):
        return 3
    if isinstance(request, LogpsRequest):
        if request.reference:
            return 2
        return 5 if request.grad else 1 if request.rollout else 4
    return 6


def refusal(trainer: Any) -> str | None:
    """Why a GRPO trainer's generation cannot go through the shared decode (``None``: it can).

    The text completes "trial N ..." in the log line that says why the trial generates alone.
    """
    args = trainer.args
    extra = sorted(set(getattr(args, "generation_kwargs", None) or {}) - _COVERED)
    if extra:
        return f"sets generation_kwargs {extra}, which the shared decode does not apply"
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return "generates with transformers' continuous batching"
    return None


class Generation:
    """Generates the completions of the GRPO trials on ``trials``' device (see the module's docstring)."""

    def __init__(self, trials: GangHost) -> None:
        self.trials = trials
        self.policy = PolicyPasses(trials)
        self._turns: Turns[Any, Any] | None = None
        self._gang: list[Member] = []
        self._share_policy = False
        self._shared_forward: set[Member] = set()  # members whose next backward is shared
        self._scoring_rollout: set[Member] = set()  # members between their decode and their rewards
        self._said: set[str] = set()
        self._numbers: dict[str, int] = {}  # adapter -> trial number (for the Decoded events)
        self.decodes = 0  # decode batches run
        # Host seconds of the gangs' runs: the members' own code, and each kind of shared step.
        self.seconds = dict.fromkeys(("members", "decode", "rewards", "logps", "backward"), 0.0)
        self.requests = 0  # requests they served (more than the batches when gangs decode together)

    def counters(self) -> dict[str, Any]:
        """Decode batches, the requests they served, the gangs' shared policy passes (fused steps), their
        shared passes without gradients (references, evaluations), those of either that shared their rows'
        prompts, those whose layers read the gang's adapters stacked, and where the gangs' host time went."""
        return {
            "decodes": self.decodes,
            "decoded_requests": self.requests,
            "fused_steps": self.policy.passes,
            "scoring_passes": self.policy.scoring_passes,
            "prefix_passes": self.policy.prefix_passes,
            "stacked_passes": self.policy.stacked_passes,
            "gang_seconds": dict(self.seconds),
        }

    def install(self, runtime: Member) -> None:
        """Make the trial's GRPO trainer generate through here (or as TRL does, where :func:`refusal` says so),
        and, in a gang that shares its policy passes, score and backpropagate its steps in them; in a gang, its
        rewards are computed with the other members' (:mod:`~optuna_rapidfire._trainers.grpo._rewards`)."""
        self._install_policy(runtime)
        self._install_rewards(runtime)
        self._numbers[runtime.state.adapter_name] = runtime.spec.number
        trainer = runtime.trainer
        reason = refusal(trainer)
        if reason is not None:
            self._say(f"Trial {runtime.spec.number} generates alone, as TRL does: it {reason}.")
            return
        original: Callable[..., Any] = _compat.grpo_generation(trainer)

        def generate(
            prompt_ids: list[list[int]],
            images: Any,
            multimodal_fields: dict[str, Any],
            num_generations: int,
            has_tool_images: bool = False,
        ) -> tuple[Completions, None]:
            if images is not None or multimodal_fields:
                self._say(f"Trial {runtime.spec.number} generates alone, as TRL does: its prompts have images.")
                return original(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
            return self.generate(runtime, prompt_ids), None

        _compat.set_grpo_generation(trainer, generate)

    def run_gang(
        self, runtimes: Sequence[M], work: Callable[[M], R], share_policy: bool = True
    ) -> list[R | BaseException]:
        """Run ``work`` for each trial in turns, the trials waiting to generate decoding together and, with
        ``share_policy``, those taking a policy step sharing its forward and backward passes.

        Returns:
            Each trial's result, or the exception that failed it alone.
        """
        device = self.trials.device
        # A thread has its own current CUDA device: the members' must be the gang's.
        setup = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
        self._turns = Turns(self._shared, name="generating-gang", setup=setup)
        self._gang, self._share_policy = list(runtimes), share_policy
        self.trials.keep_on_device(self._gang)  # a member paused at a meeting keeps its state on the device
        try:
            return self._turns.run([functools.partial(self._member, work, runtime) for runtime in runtimes])
        finally:
            self.seconds["members"] += self._turns.member_seconds
            self._turns, self._gang, self._share_policy = None, [], False
            self.trials.keep_on_device([])
            self._shared_forward.clear()
            self._scoring_rollout.clear()
            self.policy.release()
            # Members resumed with the gang's adapters left trainable (Placement.resume): none stays so.
            self.trials.resident.set_trainable([runtime.state.adapter_name for runtime in runtimes], False)

    def _member(self, work: Callable[[M], R], runtime: M) -> R:
        """A member's work in the gang; afterwards (or after its failure) no open pass waits for it."""
        try:
            return work(runtime)
        finally:
            self._shared_forward.discard(runtime)
            self._scoring_rollout.discard(runtime)
            self.policy.leave(runtime)

    # -- a gang's policy steps -------------------------------------------------------------------

    def _install_policy(self, runtime: Member) -> None:
        """Route the trial's grad-enabled log-probabilities and its backward through the gang's shared passes
        while it trains in a gang that shares them; as TRL computes them otherwise."""
        trainer: Any = runtime.trainer
        logps: Callable[..., Any] = _compat.grpo_logps(trainer)
        backward: Callable[..., Any] = trainer.accelerator.backward

        def shared_logps(
            model: Any,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            logits_to_keep: int,
            batch_size: int | None = None,
            compute_entropy: bool = False,
            compute_aux_loss: bool = False,
            **others: Any,
        ) -> Any:
            alone = functools.partial(
                logps, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss
            )
            grad = torch.is_grad_enabled()
            resident = self.trials.resident
            reference = not grad and resident.adapters_are_off()  # TRL's reference: the adapters off
            training = self.trials.resident.module.training
            rollout = runtime in self._scoring_rollout  # before its rewards: an old policy (or its reference)
            shared = (
                self._share_policy
                and self._inside()
                # an old policy scored in train mode keeps its own dropout masks, where any drops
                and (grad or reference or not training or not self.policy.drops(runtime))
                and not compute_aux_loss
                and all(value is None for value in others.values())  # no images
            )
            if not shared:
                return alone(**others)
            request = LogpsRequest(
                runtime, input_ids, attention_mask, logits_to_keep, compute_entropy, grad, reference, training, rollout
            )
            try:
                # While this member waits, the others run with the adapters on (as they found them).
                if reference:
                    resident.set_adapters_off(False)
                try:
                    answer = self._meet(runtime, request)
                finally:
                    if reference:
                        resident.set_adapters_off(True)
            except Exception as error:  # the shared pass failed: this step (and the gang's next) score alone
                if isinstance(error, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                self._share_policy = False
                _logger.warning(
                    "A shared policy pass failed (%s: %s); the gang's trials score alone.", type(error).__name__, error
                )
                return alone(**others)
            if grad:
                self._shared_forward.add(runtime)
            return answer

        def shared_backward(loss: torch.Tensor, **kwargs: Any) -> None:
            if runtime not in self._shared_forward or not self._inside():
                backward(loss, **kwargs)
                return
            self._shared_forward.discard(runtime)
            self._meet(runtime, BackwardRequest(runtime, loss))

        _compat.set_grpo_logps(trainer, shared_logps)
        _compat.set_backward(trainer, shared_backward)

    def _install_rewards(self, runtime: Member) -> None:
        """Route the trial's reward calls through the gang's shared call while it trains in a gang."""
        trainer: Any = runtime.trainer
        original: Callable[..., Any] = _compat.grpo_rewards(trainer)
        reason = rewards_refusal(trainer)
        if reason is not None:
            self._say(f"Trial {runtime.spec.number} scores its rewards alone: it {reason}.")

        def shared_rewards(inputs: Any, prompts: Any, completions: Any, completion_ids: Any) -> Any:
            self._scoring_rollout.discard(runtime)
            if reason is not None or not self._inside():
                return original(inputs, prompts, completions, completion_ids)
            request = RewardRequest(runtime, list(inputs), list(prompts), list(completions), list(completion_ids))
            return self._meet(runtime, request)

        _compat.set_grpo_rewards(trainer, shared_rewards)

    # -- one trial's generation ------------------------------------------------------------------

    def _inside(self) -> bool:
        """Whether the calling thread is a member of a gang running in turns."""
        return self._turns is not None and self._turns.inside()

    def _meet(self, runtime: Member, request: Any) -> Any:
        """Hand the trial's ``request`` to the gang's shared step and wait for its answer. Other members run
        meanwhile: afterwards the model is set up for the trial again, with its global RNG and train or eval
        mode as it left them."""
        assert self._turns is not None
        rng, training = RngState.capture(self.trials.device), self.trials.resident.module.training
        try:
            answer = self._turns.meet(request)
            while answer is _LATER:  # members of an earlier phase were served first
                answer = self._turns.meet(request)
            return answer
        finally:
            self.trials.resume_member(runtime, self._gang, rng, training)

    def generate(self, runtime: Member, prompt_ids: list[list[int]]) -> Completions:
        """The trial's completions of ``prompt_ids``: decoded alone, or with the gang members waiting too."""
        generator = torch.Generator(device=self.trials.device)
        if runtime.state.sample_rng is None:
            generator.manual_seed(int(runtime.args.seed) + _SEED_OFFSET)
        else:
            generator.set_state(runtime.state.sample_rng)
        request = _request(runtime, prompt_ids, generator)
        completions = self._meet(runtime, request) if self._inside() else self.decode([request], runtime)[0]
        runtime.state.sample_rng = generator.get_state()
        if self._inside():
            self._scoring_rollout.add(runtime)
        return completions

    # -- decoding --------------------------------------------------------------------------------

    def decode(self, requests: Sequence[DecodeRequest], first: Member) -> list[Completions]:
        """One decode batch for ``requests``, in the precision of ``first``'s trial (a gang's members share it)."""
        self.decodes += 1
        self.requests += len(requests)
        listening = events.listening(events.Decoded)
        if listening and self.trials.device.type == "cuda":
            torch.cuda.synchronize(self.trials.device)  # time the decode alone (its end waits for its tokens)
        start = time.perf_counter()
        with torch.no_grad(), first.spec.kind.autocast(first.args, self.trials.device):
            resident = self.trials.resident
            completions = decode(resident.module, requests, pad_token_id(first.trainer), layers=resident.lora_layers())
        if listening:
            events.emit(_decoded(self.trials, self._numbers, requests, completions, time.perf_counter() - start))
        return completions

    def _shared(self, requests: list[Any]) -> list[Any]:
        """What the members waiting asked for, served for the earliest phase of a step among them (decode, old
        policies' scores, references, rewards, evaluations' scores, policy steps' scores, backwards); the others
        are answered :data:`_LATER` and ask again, so members whose steps differ (a KL member scores its
        reference, the others do not) meet again at the next phase and the whole gang decodes together at the
        next step."""
        phases = [_phase(request) for request in requests]
        earliest = min(phases)
        served = [i for i, phase in enumerate(phases) if phase == earliest]
        answers: list[Any] = [_LATER] * len(requests)
        for i, answer in zip(served, self._serve([requests[i] for i in served]), strict=True):
            answers[i] = answer
        return answers

    def _serve(self, requests: list[Any]) -> list[Any]:
        """Each request's answer, by kind: one decode, one policy forward, one backward."""
        answers: list[Any] = [None] * len(requests)
        for kind, name, run in (
            (DecodeRequest, "decode", self._shared_decode),
            (RewardRequest, "rewards", shared_rewards),
            (LogpsRequest, "logps", self.policy.forward),
            (BackwardRequest, "backward", self.policy.backward),
        ):
            positions = [i for i, request in enumerate(requests) if isinstance(request, kind)]
            if not positions:
                continue
            start = time.perf_counter()
            try:
                found: list[Any] = list(run([requests[i] for i in positions]))
            except Exception as error:  # every member of this step sees it (a decode retries one by one)
                found = [error] * len(positions)
            self.seconds[name] += time.perf_counter() - start
            for i, answer in zip(positions, found, strict=True):
                answers[i] = answer
        return answers

    def _shared_decode(self, requests: list[DecodeRequest]) -> list[Completions | BaseException]:
        """The gang's decode; after a failure with several requests, each request again alone (from the
        generator state it started from), so that only a request that fails alone fails."""
        first = self._gang[0]
        starts = {id(request): request.generator.get_state() for request in requests if request.generator is not None}

        def again(request: DecodeRequest) -> None:
            assert request.generator is not None  # every request made here has its trial's generator
            request.generator.set_state(starts[id(request)])

        return each_alone_after_failure(lambda batch: self.decode(batch, first), requests, "decode", "decoding", again)

    def _say(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            _logger.info(text)


def _decoded(
    trials: GangHost,
    numbers: dict[str, int],
    requests: Sequence[DecodeRequest],
    completions: list[Completions],
    seconds: float,
) -> events.Decoded:
    """The event of a decode (:class:`optuna_rapidfire.events.Decoded`)."""
    phases = {trials.evaluating(r.adapter) or "train" for r in requests}
    first = requests[0]
    keep = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "do_sample")
    sampling = {name: getattr(first, name) for name in keep} | {"eos_token_ids": list(first.eos_token_ids)}
    return events.Decoded(
        trials=tuple(numbers.get(r.adapter, -1) for r in requests),
        rows=sum(len(c) for c in completions),
        new_tokens=sum(len(row) for c in completions for row in c),
        seconds=seconds,
        prompt_width=max(len(p) for r in requests for p in r.prompts),
        phase=phases.pop() if len(phases) == 1 else "mixed",
        sampling=sampling,
        completions=tuple(tuple(tuple(row) for row in c) for c in completions),
    )


def _request(runtime: Member, prompt_ids: list[list[int]], generator: torch.Generator) -> DecodeRequest:
    """The trial's decode request for ``prompt_ids``: its adapter, its generation settings, its generator."""
    trainer: Any = runtime.trainer
    config = trainer.generation_config
    return DecodeRequest(
        adapter=runtime.state.adapter_name,
        prompts=[list(ids) for ids in prompt_ids],
        max_new_tokens=int(config.max_new_tokens),
        temperature=float(config.temperature if config.temperature is not None else 1.0),
        top_k=config.top_k,
        top_p=float(config.top_p if config.top_p is not None else 1.0),
        min_p=config.min_p,
        repetition_penalty=float(config.repetition_penalty if config.repetition_penalty is not None else 1.0),
        do_sample=bool(config.do_sample),
        generator=generator,
        eos_token_ids=tuple(int(t) for t in trainer.eos_token_ids),
    )
