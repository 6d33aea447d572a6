#!/usr/bin/env bash
# The exact commands behind this folder's numbers (run from the repository root).
# Not part of CI: building llama.cpp takes 25 min under nice on the shared 2-core VM.
set -euo pipefail
WHEELS=~/.cache/kvpilot/wheels
LLAMA_VENV=${LLAMA_VENV:-/work/llamacpp-venv}
LLAMA_SERVER=${LLAMA_SERVER:-~/.cache/kvpilot/bin/llama-server}
OUT=${OUT:-/work/compare-runs}

# 1. llama-cpp-python 0.3.36 wheel, built once without native AMX (DESIGN.md), cached; own venv.
#    (This run's wheel: the same command through /work/llamacpp-venv/bin/pip with -v and
#    CMAKE_BUILD_PARALLEL_LEVEL=2; 25 min under nice on the busy VM.)
if ! ls $WHEELS/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON" nice -n 19 pip wheel --no-deps -w $WHEELS "llama-cpp-python==0.3.36"
fi
[ -x $LLAMA_VENV/bin/python ] || python3 -m venv $LLAMA_VENV
$LLAMA_VENV/bin/pip install -q --find-links $WHEELS "llama-cpp-python[server]==0.3.36"

# 2. llama.cpp's C++ llama-server (parallel slots) from the llama.cpp source vendored in that
#    same sdist (vendor/llama.cpp), same flags; the binary is cached. (This run's binary was built
#    from a copy of vendor/llama.cpp taken from pip's build directory of step 1, which diff -r
#    finds identical to the sdist's; 35 min under nice.)
if [ ! -x "$LLAMA_SERVER" ]; then
  SRC=$(mktemp -d) && pip download --no-deps --no-binary llama-cpp-python -d $SRC "llama-cpp-python==0.3.36"
  tar -xzf $SRC/llama_cpp_python-0.3.36.tar.gz -C $SRC
  nice -n 19 cmake -S $SRC/llama_cpp_python-0.3.36/vendor/llama.cpp -B $SRC/build -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
  nice -n 19 cmake --build $SRC/build --target llama-server -j 2
  mkdir -p "$(dirname "$LLAMA_SERVER")" && cp $SRC/build/bin/llama-server "$LLAMA_SERVER"
fi

# 3. Our engine from a clean snapshot of a commit (the working tree may hold others' edits).
COMMIT=$(git rev-parse --short HEAD)
SNAP=/tmp/kvpilot-snap-$COMMIT
if [ ! -d $SNAP ]; then
  mkdir -p $SNAP/src $SNAP/pkg/kvpilot && git archive HEAD | tar -x -C $SNAP/src && touch $SNAP/pkg/kvpilot/__init__.py
  for p in engine kernels operator tuner bench cli; do ln -s $SNAP/src/$p $SNAP/pkg/kvpilot/$p; done
fi

# 4. The comparison, every server on one core, then on both. The VM's 2 cores are shared with
#    other jobs (load 3-6): OpenMP's spinning barriers (libgomp, in llama.cpp and torch) then
#    collapse, e.g. llama-server at 2 threads decoded 0.7 tok/s with OMP_WAIT_POLICY=active,
#    35 with passive, 40 at 1 thread. So every server runs with passive waiting.
export OMP_WAIT_POLICY=PASSIVE
for T in 1 2; do
  PYTHONPATH=$SNAP/pkg .venv/bin/python -m kvpilot.cli.main bench compare \
    --peers kvpilot,llama-cpp-python,llama-server --llama-cpp-python $LLAMA_VENV/bin/python \
    --llama-server "$LLAMA_SERVER" --threads $T --num-prompts 16 --max-output-len 128 \
    --request-rates 0.1,0.2,0.4,0.8 --max-model-len 1024 --max-num-seqs 16 \
    --slo-ttft-ms 2000 --slo-itl-ms 200 --seed 0 --disable-tqdm \
    --output-dir $OUT/threads$T --metadata commit=$COMMIT omp_wait_policy=$OMP_WAIT_POLICY
done
