#!/usr/bin/env bash
# Build llama.cpp (through llama-cpp-python's sdist, which vendors it) for the `llamacpp` tests,
# and install it into the active Python. llama-cpp-python has no wheels on the index, so this
# builds one from source: CPU only, the llama library alone (no tests, examples, server, curl,
# multimodal), and keeps the wheel under ~/.cache/yamlformer-llamacpp/<version>/ so a second
# run (or a CI cache of that folder) installs in seconds.
#
#   .ci/llamacpp.sh            # build if needed, then pip install the wheel
#   python -m pytest -m llamacpp
#
# LLAMACPP_VERSION picks the llama-cpp-python release (default below); LLAMACPP_SDIST names an
# sdist already on disk; LLAMACPP_CACHE moves the cache; LLAMACPP_JOBS sets build parallelism.
set -euo pipefail
version="${LLAMACPP_VERSION:-0.3.36}"
cache="${LLAMACPP_CACHE:-$HOME/.cache/yamlformer-llamacpp}/$version"
jobs="${LLAMACPP_JOBS:-$(nproc 2>/dev/null || echo 2)}"
python="${PYTHON:-python}"
mkdir -p "$cache"

wheel="$(ls "$cache"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
    sdist="${LLAMACPP_SDIST:-$cache/llama_cpp_python-$version.tar.gz}"
    if [ ! -f "$sdist" ]; then
        "$python" -m pip download --no-deps --no-binary :all: -d "$cache" \
            "llama-cpp-python==$version"
        sdist="$cache/llama_cpp_python-$version.tar.gz"
    fi
    start=$(date +%s)
    # GGML_NATIVE: the wheel is built for this CPU; the cache is per machine (or per CI image).
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
-DGGML_BLAS=OFF -DGGML_RPC=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
-DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
        "$python" -m pip wheel --no-deps -w "$cache" "$sdist"
    echo "llama-cpp-python $version built in $(($(date +%s) - start)) s"
    wheel="$(ls "$cache"/llama_cpp_python-"$version"-*.whl | head -n1)"
fi
"$python" -m pip install -q --no-deps --force-reinstall "$wheel"
# its runtime dependencies (numpy, typing-extensions, diskcache, jinja2) from the index
"$python" -m pip install -q "numpy>=1.20" "typing-extensions>=4.5" "diskcache>=5.6.1" "jinja2>=2.11.3"
"$python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'importable')"
