#!/usr/bin/env bash
# GPU test files, each in its own pytest process (a device-side assert poisons every CUDA call
# after it in the same process), in one device call; logs tarred to $OUT/gpu_tests.tgz:
#   FILES="tests/core/test_quant_gpu.py tests/glm5/test_engine_gpu.py" bash benchmarks/gpu_tests.sh
# PYTEST_ARGS (default: -m "not slow") and PER_FILE_S (default 240) apply to every file; a
# file listed as path::test or with -k needs quoting inside FILES as one word per file.
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
: "${FILES:?list the test files to run}"
PER_FILE_S=${PER_FILE_S:-240}
mkdir -p "$OUT"
logs=$(mktemp -d)
for file in $FILES; do
  name=$(echo "$file" | tr '/:' '__')
  start=$(date +%s)
  eval timeout "$PER_FILE_S" python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-'-m "not slow"'} \
    "$file" > "$logs/$name.log" 2>&1
  code=$?
  echo "$file: exit $code in $(( $(date +%s) - start )) s: $(tail -1 "$logs/$name.log")"
  grep -E "^(FAILED|ERROR) " "$logs/$name.log" | head -8
  # After every file, so that a call cut short by its time limit still brings the logs back.
  tar czf "$OUT/gpu_tests.tgz" -C "$logs" .
done
