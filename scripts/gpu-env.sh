# Source this on a GPU machine before running an mtrain binary built with `--features cuda`:
#   source scripts/gpu-env.sh
#
# The binary links the CUDA 13 libraries (cudart, cuBLAS, cuRAND, NVRTC) and NCCL dynamically and
# the driver library (libcuda.so.1) at run time. On a machine with a PyTorch environment these
# libraries live inside its `nvidia` Python packages, and the driver under /usr/local/nvidia;
# neither is on the default library path. A system CUDA install ($CUDA_HOME/lib64) is used too.
_mtrain_libs=""
_mtrain_sp=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null || true)
if [ -n "$_mtrain_sp" ]; then
  for _d in "$_mtrain_sp/nvidia/cu13/lib" "$_mtrain_sp/nvidia/nccl/lib"; do
    [ -d "$_d" ] && _mtrain_libs="$_mtrain_libs:$_d"
  done
fi
for _d in "${CUDA_HOME:+$CUDA_HOME/lib64}" /usr/local/nvidia/lib64; do
  [ -n "$_d" ] && [ -d "$_d" ] && _mtrain_libs="$_mtrain_libs:$_d"
done
export LD_LIBRARY_PATH="${_mtrain_libs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
unset _mtrain_libs _mtrain_sp _d
# NVLink SHARP (multicast) stays off: on shared hosts it can take every GPU of the node down.
export NCCL_NVLS_ENABLE=0

# mtrain_unpack SRC.xz DST: unpacks a binary carried in .gpu/ (with python's lzma: a GPU machine
# may have no xz) and makes it executable.
mtrain_unpack() {
  python3 -c 'import lzma, shutil, sys
with lzma.open(sys.argv[1]) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)' "$1" "$2" && chmod +x "$2"
}
