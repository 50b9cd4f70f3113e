#!/usr/bin/env bash
# Runs the codec tests against the CPU kernels built with AddressSanitizer and UndefinedBehavior-
# Sanitizer; fails on any sanitizer report (or test failure).
#
#   scripts/sanitize.sh                          # tests/test_codec.py tests/test_numerics.py tests/test_summable.py tests/test_qsgd_leaves.py tests/test_qsgd_chunks.py
#   scripts/sanitize.sh tests/test_codec.py -k isa   # any other pytest arguments
#
# The sanitized CPU module (CMake option QCOMM_SANITIZE, CUDA off) is built into build/sanitize,
# never into the installed package; jax_qcomm loads it instead of the installed one through
# QCOMM_CPU_MODULE, and tests/test_codec.py::test_cpu_module_is_the_requested_build asserts that
# the kernels under test are that file, built with these sanitizers. Python and jaxlib are not
# instrumented, so the interpreter runs with libasan preloaded (leak detection off: the
# interpreter's own allocations at exit are not ours). Reports of every process (tests start
# subprocesses too) are written to build/sanitize/reports/ and any report fails the run.
#
# Needs .venv (scripts/bootstrap.sh) and gcc/g++ with libasan and libubsan.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
VPY=$ROOT/.venv/bin/python
[[ -x $VPY ]] || { echo "error: $VPY not found: run scripts/bootstrap.sh first" >&2; exit 1; }
BUILD=$ROOT/build/sanitize
REPORTS=$BUILD/reports
start=$(date +%s)

# cmake and ninja from the venv (build requirements) where bootstrap installed them.
CMAKE=$ROOT/.venv/bin/cmake; [[ -x $CMAKE ]] || CMAKE=$(command -v cmake)
NINJA=$ROOT/.venv/bin/ninja; [[ -x $NINJA ]] || NINJA=$(command -v ninja || true)
gen=()
[[ -n $NINJA ]] && gen=(-G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA")

echo "[sanitize] building the CPU module with -fsanitize=address,undefined in $BUILD"
"$CMAKE" -S "$ROOT" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DQCOMM_SANITIZE=ON \
  -DQCOMM_CUDA=OFF -DPython_EXECUTABLE="$VPY" > "$BUILD.configure.log" 2>&1 \
  || { cat "$BUILD.configure.log" >&2; exit 1; }
"$CMAKE" --build "$BUILD" --target _qcomm_cpu -j 2 > "$BUILD.build.log" 2>&1 \
  || { cat "$BUILD.build.log" >&2; exit 1; }
SO=$(ls "$BUILD"/_qcomm_cpu*.so)
# The ASan runtime the module was linked against must come first in the process, and libstdc++
# with it: python is a C program, and without libstdc++ loaded when ASan starts, its __cxa_throw
# interceptor has nothing to forward to (a CHECK failure at jaxlib's first C++ exception).
ASAN_LIB=$(ldd "$SO" | awk '/libasan\.so/ {print $3; exit}')
STDCXX_LIB=$(ldd "$SO" | awk '/libstdc\+\+\.so/ {print $3; exit}')
[[ -f $ASAN_LIB ]] || { echo "error: $SO is not linked against libasan" >&2; exit 1; }
[[ -f $STDCXX_LIB ]] || { echo "error: $SO is not linked against libstdc++" >&2; exit 1; }
PRELOAD="$ASAN_LIB:$STDCXX_LIB"

rm -rf "$REPORTS"
mkdir -p "$REPORTS"
export QCOMM_CPU_MODULE=$SO
export QCOMM_REQUIRE_SANITIZERS=address,undefined
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$REPORTS/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan"

fail_on_reports() {
  if compgen -G "$REPORTS/*" > /dev/null; then
    echo "[sanitize] FAILED: sanitizer reports:" >&2
    for f in "$REPORTS"/*; do echo "== $f" >&2; cat "$f" >&2; done
    exit 1
  fi
}

# The module must load under the preloaded runtime and be the sanitized build.
LD_PRELOAD="$PRELOAD" "$VPY" -c '
import os, jax_qcomm
from jax_qcomm import _ffi
m = _ffi._qcomm_cpu
assert m is not None and os.path.samefile(m.__file__, os.environ["QCOMM_CPU_MODULE"]), m
assert m.sanitizers == "address,undefined", m.sanitizers
print(f"[sanitize] loaded {m.__file__} (sanitizers: {m.sanitizers}, ISA: {_ffi.cpu_isa()})")
'
fail_on_reports

args=("$@")
(( ${#args[@]} )) || args=(tests/test_codec.py tests/test_numerics.py tests/test_summable.py tests/test_qsgd_leaves.py tests/test_qsgd_chunks.py)
echo "[sanitize] pytest ${args[*]}"
set +e
LD_PRELOAD="$PRELOAD" "$VPY" -m pytest -q -p no:cacheprovider "${args[@]}"
rc=$?
set -e
fail_on_reports
if (( rc != 0 )); then
  echo "[sanitize] FAILED: pytest exit status $rc" >&2
  exit "$rc"
fi
echo "[sanitize] passed: no sanitizer reports, $(( $(date +%s) - start )) s"
