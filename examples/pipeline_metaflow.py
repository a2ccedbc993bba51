"""A tuning step in a pipeline: Metaflow runs ``optuna_rapidfire.tune`` on a declared search, then a downstream
step reads ``summary.json`` and loads the best adapter onto the base model with PEFT.

    pip install metaflow
    python examples/pipeline_metaflow.py run --search examples/search_sft.yaml

Running the flow again continues the same study: finished trials are kept, only the rest of the budget runs,
and the downstream step gets the best adapter of the whole study.

Why Metaflow: it is one pure-Python package from PyPI whose local runner needs nothing else (no server, no
database, no container): ``python flow.py run`` runs each step as a process on this machine and keeps the steps'
artifacts in a local ``.metaflow`` folder. On a 2-core CI machine without a GPU or a network it adds about a
second to the steps themselves, and the same flow runs on Kubernetes, AWS Batch or Argo Workflows unchanged.
The others need more around them: Prefect runs flows against an API server (locally a temporary one it starts,
with its own database) and brings a web stack; ZenML keeps a store of its own; Kubeflow Pipelines' local
runner wants Docker, or installs each component's packages into a fresh environment.
"""

from __future__ import annotations

from metaflow import FlowSpec, Parameter, step


class TuneFlow(FlowSpec):
    """start -> tune (the search, resumable) -> use_best (summary.json, best adapter on the base) -> end."""

    search = Parameter("search", help="the search file (YAML)", default="examples/search_sft.yaml")

    @step
    def start(self) -> None:
        self.next(self.tune)

    @step
    def tune(self) -> None:
        # Heavy imports stay inside the steps: Metaflow imports this file in every step's process.
        import optuna_rapidfire

        result = optuna_rapidfire.tune(self.search)  # raises when no trial completed: the step then fails
        self.summary_path = str(result.summary_path)
        self.next(self.use_best)

    @step
    def use_best(self) -> None:
        import json
        from pathlib import Path

        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        summary = json.loads(Path(self.summary_path).read_text())
        best = summary["best"]
        base = AutoModelForCausalLM.from_pretrained(summary["model"])
        tokenizer = AutoTokenizer.from_pretrained(summary["model"])
        model = PeftModel.from_pretrained(base, best["adapter_path"]).eval()
        prompt = "Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer:"
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        self.sample = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        self.best = best
        self.adapters = list(model.peft_config)
        self.next(self.end)

    @step
    def end(self) -> None:
        print(f"best trial {self.best['number']}: value {self.best['value']}, params {self.best['params']}")
        print(f"loaded the best adapter from {self.best['adapter_path']} ({', '.join(self.adapters)})")
        print(f"sample completion: {self.sample!r}")


if __name__ == "__main__":
    TuneFlow()
