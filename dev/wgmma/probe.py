"""Runs the warpgroup-product probes of probe.cu on the GPU at hand (Hopper: sm_90) and says
which shared-memory layouts, descriptors and register fragments give the product — the
ground truth for the Hopper attention kernels to come (docs/GPU.md, "What comes next").

`python3 dev/wgmma/probe.py` on the GPU machine (PyTorch for the buffers and the reference
products; NVRTC and the driver through ctypes: NVRTC from XTRAIN_CUDA_LIB_PATH's folders or
the loader's path, as scripts/gpu-check.sh's `probe` section gives it). Prints a line per mode
and (leading, stride) byte-offset candidate: the largest difference from PyTorch's product of
the same bf16 values in fp32, "OK" where it is within fp32 summation error. Exits 0 after a
run whatever it finds (a probe, not a test), 2 where there is no Hopper GPU.
"""
import ctypes
import glob
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def load_nvrtc():
    dirs = [d for d in os.environ.get("XTRAIN_CUDA_LIB_PATH", "").split(":") if d]
    for d in dirs + [""]:
        for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
            path = os.path.join(d, name) if d else name
            try:
                if d:
                    # NVRTC opens its builtins library by name: load it first, from beside it.
                    for b in glob.glob(os.path.join(d, "libnvrtc-builtins.so*")):
                        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise SystemExit("probe: no NVRTC (name its folder in XTRAIN_CUDA_LIB_PATH)")


def compile_cubin(nvrtc, name="probe.cu"):
    """`name` (beside this script), after wgmma.cuh, compiled for sm_90a: the cubin."""
    # The shared pieces (wgmma.cuh) in front, `#line` marks keeping the messages on each file.
    src = b"".join(b'#line 1 "%s"\n' % f.encode() + open(os.path.join(HERE, f), "rb").read()
                   for f in ("wgmma.cuh", name))
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90a", b"--std=c++17"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if r != 0:
        raise SystemExit(f"probe: {name} did not compile:\n{log.value.decode()}")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    assert nvrtc.nvrtcGetCUBIN(prog, cubin) == 0
    return cubin


def check(r, what):
    if r != 0:
        raise SystemExit(f"probe: {what} failed: CUresult {r}")


def hopper():
    """Whether the GPU at hand is a Hopper (sm_90); the primary context made current."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    return True


def function(cu, cubin, name):
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check(cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
    check(cu.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
    return fn


def launch(cu, fn, grid, block, shared, args, what):
    """Launches `fn` with ctypes values `args` on PyTorch's current stream."""
    params = (ctypes.c_void_p * len(args))(
        *[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in args])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    check(cu.cuLaunchKernel(fn, *grid, *block, shared, stream, params, None), what)


NAMES = {0: "A, B in shared memory, K-major (S = Q K^T)",
         1: "A in registers, B K-major (S = Q K^T)",
         2: "A in registers, B MN-major (O = P V)"}
# (leading, stride) byte offsets: the expected ones first (K-major swizzled: LBO unused, SBO
# 1024 = 8 rows of 128 bytes; MN-major: the two 8-row groups of a 16-row k-step 1024 bytes
# apart), then their neighbours.
CANDIDATES = {0: [(16, 1024), (1024, 1024), (0, 1024), (1024, 16), (8192, 1024)],
              1: [(16, 1024), (1024, 1024), (0, 1024), (1024, 16), (8192, 1024)],
              2: [(1024, 16), (16, 1024), (1024, 1024), (1024, 8192), (8192, 1024),
                  (2048, 1024), (1024, 2048), (128, 1024), (1024, 128)]}


def sweep(cu, fn, mode, quiet=False):
    """The (lbo, sbo) candidates of `mode` that give the product, each line printed."""
    torch.manual_seed(0)
    a = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    b = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    out = torch.empty(64, 64, device="cuda", dtype=torch.float32)
    ref = a.float() @ (b.float() if mode == 2 else b.float().T)
    good = []
    for lbo, sbo in CANDIDATES[mode]:
        out.fill_(float("nan"))
        launch(cu, fn, (1, 1, 1), (128, 1, 1), 0,
               [ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(b.data_ptr()),
                ctypes.c_void_p(out.data_ptr()), ctypes.c_int(mode), ctypes.c_int(lbo),
                ctypes.c_int(sbo)], "cuLaunchKernel")
        check(cu.cuCtxSynchronize(), f"mode {mode} lbo {lbo} sbo {sbo}")
        err = (out - ref).abs().max().item()
        ok = err < 1e-3 * ref.abs().max().item()
        if ok:
            good.append((lbo, sbo))
        if not quiet:
            print(f"mode {mode} ({NAMES[mode]}), lbo {lbo}, sbo {sbo}: max |diff| {err:.3g}"
                  f"{'  OK' if ok else ''}", flush=True)
    return good


def main():
    if not hopper():
        print("probe: no Hopper GPU (sm_90): nothing to probe")
        return 2
    cu = ctypes.CDLL("libcuda.so.1")
    fn = function(cu, compile_cubin(load_nvrtc()), "probe")
    for mode in (0, 1, 2):
        sweep(cu, fn, mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
