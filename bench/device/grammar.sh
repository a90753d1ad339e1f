#!/bin/bash
# Grammar-constrained decoding on the lent GPU (device tool, carry [".whl"], after
# bench/device/fetch-wheels.sh): the GPU grammar tests, then bench/grammar.py on GPU 0.
#   bash bench/device/grammar.sh
# Results land in $OUT: grammar_tests.txt, grammar_bench.txt, grammar.json.
set -u
mkdir -p /tmp/deps
python3 -c "import zipfile, glob; [zipfile.ZipFile(w).extractall('/tmp/deps') for w in glob.glob('.whl/pd/*.whl')]"
export PYTHONPATH=/tmp/deps:$PWD
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -m gpu \
  tests/worker/test_grammar_gpu.py > "$OUT/grammar_tests.txt" 2>&1
echo "pytest rc=$? at ${SECONDS}s" >> "$OUT/grammar_tests.txt"
CUDA_VISIBLE_DEVICES=0 timeout $((575 - SECONDS)) python3 -m bench.grammar --device cuda \
  --threads 8 --out "$OUT" > "$OUT/grammar_bench.txt" 2>&1
echo "bench rc=$? at ${SECONDS}s" >> "$OUT/grammar_bench.txt"
tail -20 "$OUT/grammar_tests.txt"; tail -12 "$OUT/grammar_bench.txt"
