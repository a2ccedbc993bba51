#!/usr/bin/env bash
# Set up (first run) and run the checks: ruff (lint + format), mypy, and the whole test suite.
"$(dirname "${BASH_SOURCE[0]}")/system-deps.sh"
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh" dev
ruff check .
ruff format --check .
mypy
HF_HUB_OFFLINE=1 python -m pytest -q --durations=15 "$@"
# The tests marked numerics compare floats computed along different paths: run them again on this CPU's
# other kernel sets (ATen's, chosen by ATEN_CPU_CAPABILITY), so that another kernel's rounding fails here
# before it fails on someone else's machine. A set the CPU lacks (AVX2 needs avx2 and fma) is skipped,
# and so is the one the run above used. Without arguments, only the files that hold such tests are
# collected (collecting the whole suite costs more than the tests).
native=$(python -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
if [ $# -eq 0 ]; then
  mapfile -t selection < <(grep -rlw --include='test_*.py' 'pytest.mark.numerics' tests samplers)
else
  selection=("$@")
fi
for capability in default avx2; do
  if [ "$capability" = "$native" ]; then
    continue
  fi
  if [ "$capability" = avx2 ] && ! { grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; } 2>/dev/null; then
    continue
  fi
  echo "Numerics tests again with ATEN_CPU_CAPABILITY=$capability:"
  # Exit status 5: the selection holds no numerics test.
  ATEN_CPU_CAPABILITY=$capability HF_HUB_OFFLINE=1 python -m pytest -q -m numerics "${selection[@]}" || [ $? -eq 5 ]
done
