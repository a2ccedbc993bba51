"""The parts of ``python -m benchmarks.run``, one module (or package) each.

Every part has ``run(bench, shapes, save)``, which measures and returns the part's JSON (``save`` writes what
it has so far, so that a call cut short keeps it), and, where the report shows it, ``summary(data)`` (its
keys of ``summary.json``) and ``markdown(data)`` (its section of ``results.md``). ``fused_summary``,
``fused_profile`` and ``processes`` are the fused part's pieces (its report, its profiled runs, its plain-TRL
processes baseline), not parts of their own.
"""
