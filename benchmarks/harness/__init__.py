"""What every benchmark part shares: the harness.

- :mod:`~benchmarks.harness.models`: model shapes, random-weight models, LoRA and training configs;
- :mod:`~benchmarks.harness.measure`: device synchronisation, percentiles, peak memory, freeing memory;
- :mod:`~benchmarks.harness.environment`: the machine and library versions every result carries;
- :mod:`~benchmarks.harness.hooks`: every seam into optuna_rapidfire's internals (the only module that
  patches or imports them, for the parts);
- :mod:`~benchmarks.harness.workers`: OS worker processes started together (plain-TRL baselines);
- :mod:`~benchmarks.harness.bench`: one call's context (options, scratch folder, tokenizer, executors).

The harness imports nothing from :mod:`benchmarks.parts`; parts import the harness.
"""
