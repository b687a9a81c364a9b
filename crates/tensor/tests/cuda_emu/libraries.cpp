// The NVIDIA libraries xtrain opens (crates/tensor/src/cuda/sys.rs) — the driver, NVRTC,
// cuBLASLt and NCCL — as one CPU library for the tests (mod.rs builds it and names it
// libcuda.so.1, libnvrtc.so.13, libcublasLt.so.13 and libnccl.so.2 in a folder the tests put
// in XTRAIN_CUDA_LIB_PATH). Only the calls xtrain makes, with the arguments it passes:
//
// - the driver: one device (compute capability 9.0, four multiprocessors, 80 GiB unless
//   XTRAIN_CUDA_EMU_MEMORY_MIB says otherwise: an account, the memory is taken from the host
//   as allocated); device memory is host memory; every copy,
//   fill and launch runs when it is queued (streams and events keep their order trivially;
//   an event's time is when it was recorded); a launch runs the module's xt_emu_launch
//   (device.h) under one lock, and its failure is the launch's error, with the message on
//   stderr;
// - NVRTC: a program is compiled by the host's C++ compiler ($CXX, else c++) after device.h,
//   into a shared object that stands for the cubin; its kernels (extern "C" __global__) get a
//   thunk each that unpacks cuLaunchKernel's argument array;
// - cuBLASLt: D = alpha op(A) op(B) + beta C in column-major order, fp32, bf16 or fp16
//   operands, the sums in double rounded once to D's type;
// - NCCL: communicators of one rank (the one device), whose collectives copy, and whose sends
//   to itself are matched with its receives in order when the group ends.
#include <ctype.h>
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "halves.h"

#ifndef XT_EMU_DEVICE_H
#error "build with -DXT_EMU_DEVICE_H=\"<path of device.h>\""
#endif

#define API extern "C" __attribute__((visibility("default")))

namespace {

// ---- driver -------------------------------------------------------------------------------

enum : int {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    INVALID_IMAGE = 200,
    NOT_FOUND = 500,
    LAUNCH_FAILED = 719,
};

std::mutex lock; // one launch, allocation or module load at a time
std::map<uint64_t, size_t> allocations;
size_t allocated = 0;

size_t total_memory() {
    const char* v = getenv("XTRAIN_CUDA_EMU_MEMORY_MIB");
    size_t mib = v ? strtoull(v, nullptr, 10) : 0;
    return (mib ? mib : 80 << 10) << 20;
}

double now_ms() {
    struct timeval tv;
    gettimeofday(&tv, nullptr);
    return tv.tv_sec * 1e3 + tv.tv_usec * 1e-3;
}

struct Event {
    double ms = 0;
};

typedef int (*LaunchFn)(void (*)(void**), void**, const unsigned*, const unsigned*, unsigned,
                        char*, size_t);

struct Module {
    void* so;
    LaunchFn launch;
};

struct Function {
    Module* module;
    void (*thunk)(void**);
    std::string name;
    int max_dynamic_smem = 48 << 10;
};

const char MAGIC[8] = {'X', 'T', 'E', 'M', 'U', 'S', 'O', 0};

// A template for mkstemp / mkdtemp in $TMPDIR (else /tmp).
std::string temp_template(const char* what) {
    const char* t = getenv("TMPDIR");
    return std::string(t && *t ? t : "/tmp") + "/xtrain-cuda-emu-" + what + "-XXXXXX";
}

} // namespace

API int cuInit(unsigned) { return SUCCESS; }
API int cuDriverGetVersion(int* v) { *v = 13000; return SUCCESS; }

namespace {

// The driver's result codes that the emulation returns: name and text.
const struct {
    int code;
    const char *name, *text;
} ERRORS[] = {
    {SUCCESS, "CUDA_SUCCESS", "no error"},
    {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
};

int describe(int r, const char** s, bool name) {
    for (const auto& e : ERRORS)
        if (e.code == r) {
            *s = name ? e.name : e.text;
            return SUCCESS;
        }
    *s = name ? "CUDA_ERROR_UNKNOWN" : "unknown error";
    return INVALID_VALUE;
}

} // namespace

API int cuGetErrorName(int r, const char** s) { return describe(r, s, true); }
API int cuGetErrorString(int r, const char** s) { return describe(r, s, false); }

API int cuDeviceGetCount(int* n) { *n = 1; return SUCCESS; }
API int cuDeviceGet(int* d, int ordinal) {
    if (ordinal != 0) return INVALID_VALUE;
    *d = 0;
    return SUCCESS;
}
API int cuDeviceGetName(char* name, int len, int) {
    snprintf(name, (size_t)len, "CPU emulation of a CUDA device (xtrain tests)");
    return SUCCESS;
}
API int cuDeviceGetAttribute(int* v, int attr, int) {
    switch (attr) {
    case 16: *v = 4; break;          // multiprocessors
    case 75: *v = 9; break;          // compute capability major
    case 76: *v = 0; break;          // minor
    case 97: *v = 232448; break;     // shared memory per block, opt-in (sm_90's)
    default: return INVALID_VALUE;
    }
    return SUCCESS;
}
API int cuDeviceTotalMem_v2(size_t* bytes, int) { *bytes = total_memory(); return SUCCESS; }
API int cuDevicePrimaryCtxRetain(void** ctx, int) {
    static int context;
    *ctx = &context;
    return SUCCESS;
}
API int cuCtxSetCurrent(void*) { return SUCCESS; }
API int cuCtxSynchronize() { return SUCCESS; }

API int cuMemAlloc_v2(uint64_t* p, size_t bytes) {
    std::lock_guard<std::mutex> g(lock);
    size_t rounded = (bytes + 255) / 256 * 256;
    if (rounded == 0) rounded = 256;
    if (allocated + rounded > total_memory()) return OUT_OF_MEMORY;
    void* m = aligned_alloc(256, rounded);
    if (!m) return OUT_OF_MEMORY;
    *p = (uint64_t)m;
    allocations[*p] = rounded;
    allocated += rounded;
    return SUCCESS;
}
API int cuMemFree_v2(uint64_t p) {
    std::lock_guard<std::mutex> g(lock);
    auto it = allocations.find(p);
    if (it == allocations.end()) return INVALID_VALUE;
    allocated -= it->second;
    allocations.erase(it);
    free((void*)p);
    return SUCCESS;
}
API int cuMemAllocHost_v2(void** p, size_t bytes) {
    *p = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096 + 4096);
    return *p ? SUCCESS : OUT_OF_MEMORY;
}
API int cuMemFreeHost(void* p) { free(p); return SUCCESS; }
API int cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(lock);
    *total = total_memory();
    *free_bytes = *total - allocated;
    return SUCCESS;
}
API int cuMemcpyHtoDAsync_v2(uint64_t d, const void* h, size_t n, void*) {
    memcpy((void*)d, h, n);
    return SUCCESS;
}
API int cuMemcpyDtoHAsync_v2(void* h, uint64_t d, size_t n, void*) {
    memcpy(h, (const void*)d, n);
    return SUCCESS;
}
API int cuMemcpyDtoDAsync_v2(uint64_t d, uint64_t s, size_t n, void*) {
    memmove((void*)d, (const void*)s, n);
    return SUCCESS;
}
API int cuMemsetD8Async(uint64_t d, unsigned char v, size_t n, void*) {
    memset((void*)d, v, n);
    return SUCCESS;
}

API int cuStreamCreate(void** s, unsigned) {
    static int streams;
    *s = &streams;
    return SUCCESS;
}
API int cuStreamDestroy_v2(void*) { return SUCCESS; }
API int cuStreamSynchronize(void*) { return SUCCESS; }
API int cuStreamQuery(void*) { return SUCCESS; }
API int cuStreamWaitEvent(void*, void*, unsigned) { return SUCCESS; }
API int cuEventCreate(void** e, unsigned) { *e = new Event; return SUCCESS; }
API int cuEventDestroy_v2(void* e) { delete (Event*)e; return SUCCESS; }
API int cuEventRecord(void* e, void*) { ((Event*)e)->ms = now_ms(); return SUCCESS; }
API int cuEventSynchronize(void*) { return SUCCESS; }
API int cuEventQuery(void*) { return SUCCESS; }
API int cuEventElapsedTime(float* ms, void* a, void* b) {
    *ms = (float)(((Event*)b)->ms - ((Event*)a)->ms);
    return SUCCESS;
}

// The image is MAGIC, the shared object's length (8 bytes) and the shared object.
API int cuModuleLoadData(void** module, const void* image) {
    if (memcmp(image, MAGIC, 8) != 0) {
        fprintf(stderr, "cuda-emu: cuModuleLoadData was given an image the emulated NVRTC "
                        "did not make (a cubin from a real NVRTC in the kernel cache?)\n");
        return INVALID_IMAGE;
    }
    uint64_t len;
    memcpy(&len, (const char*)image + 8, 8);
    std::lock_guard<std::mutex> g(lock);
    std::string tpl = temp_template("module");
    char* path = tpl.data();
    int fd = mkstemp(path);
    if (fd < 0) return INVALID_IMAGE;
    const char* bytes = (const char*)image + 16;
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, bytes + done, len - done);
        if (w <= 0) break;
        done += (size_t)w;
    }
    close(fd);
    void* so = done == len ? dlopen(path, RTLD_NOW | RTLD_LOCAL) : nullptr;
    if (!so) fprintf(stderr, "cuda-emu: loading a module failed: %s\n", dlerror());
    unlink(path);
    if (!so) return INVALID_IMAGE;
    LaunchFn launch = (LaunchFn)dlsym(so, "xt_emu_launch");
    if (!launch) return INVALID_IMAGE;
    *module = new Module{so, launch};
    return SUCCESS;
}
API int cuModuleGetFunction(void** f, void* module, const char* name) {
    Module* m = (Module*)module;
    std::string sym = std::string("xt_emu_thunk_") + name;
    void* thunk = dlsym(m->so, sym.c_str());
    if (!thunk) return NOT_FOUND;
    *f = new Function{m, (void (*)(void**))thunk, name};
    return SUCCESS;
}
API int cuFuncSetAttribute(void* f, int attr, int value) {
    if (attr != 8) return INVALID_VALUE; // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if (value < 0 || value > 232448) return INVALID_VALUE;
    ((Function*)f)->max_dynamic_smem = value;
    return SUCCESS;
}
API int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, unsigned smem, void*, void** params, void** extra) {
    Function* fn = (Function*)f;
    if (extra || !params) return INVALID_VALUE;
    // The GPU's limits: a launch past them fails there, so it fails here.
    if (gx == 0 || gy == 0 || gz == 0 || gx > 2147483647u || gy > 65535 || gz > 65535 ||
        bx * by * bz == 0 || bx * by * bz > 1024 || bz > 64 ||
        smem > (unsigned)fn->max_dynamic_smem) {
        fprintf(stderr,
                "cuda-emu: %s launched with grid (%u, %u, %u), block (%u, %u, %u), %u bytes of "
                "shared memory (at most %d allowed it): past the GPU's limits\n",
                fn->name.c_str(), gx, gy, gz, bx, by, bz, smem, fn->max_dynamic_smem);
        return INVALID_VALUE;
    }
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    char error[512] = {0};
    std::lock_guard<std::mutex> g(lock);
    if (fn->module->launch(fn->thunk, params, grid, block, smem, error, sizeof error) != 0) {
        fprintf(stderr, "cuda-emu: %s failed: %s\n", fn->name.c_str(), error);
        return LAUNCH_FAILED;
    }
    return SUCCESS;
}

// ---- NVRTC ------------------------------------------------------------------------------

namespace {

struct Program {
    std::string source, name, log;
    std::vector<char> image;
};

bool run(const std::string& cmd, std::string& log) {
    std::string full = cmd + " 2>&1";
    FILE* p = popen(full.c_str(), "r");
    if (!p) {
        log += "cannot run: " + cmd + "\n";
        return false;
    }
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) log.append(buf, n);
    int status = pclose(p);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

bool slurp(const std::string& path, std::string& out) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return false;
    std::stringstream ss;
    ss << in.rdbuf();
    out = ss.str();
    return true;
}

// `extern __shared__ [__align__(n)] T name[];` -> `T* name = (T*)xt_emu::smem_base();`
std::string dynamic_shared_to_pointers(const std::string& src) {
    static const std::regex decl(
        R"(extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\s*\[\s*\]\s*;)");
    return std::regex_replace(src, decl, "$1* $2 = ($1*)xt_emu::smem_base();");
}

int compile(Program& p) {
    const char* cxx_env = getenv("CXX");
    std::string cxx = cxx_env && *cxx_env ? cxx_env : "c++";
    std::string tpl = temp_template("nvrtc");
    char* dir_tpl = tpl.data();
    if (!mkdtemp(dir_tpl)) {
        p.log = "cannot make a temporary folder";
        return 1;
    }
    std::string dir = dir_tpl;
    std::string src = dynamic_shared_to_pointers(p.source);
    {
        std::ofstream out(dir + "/kernel.cpp");
        out << src;
    }
    std::string common = cxx + " -std=c++17 -w -fPIC -ffp-contract=off -fno-strict-aliasing "
                               "-include '" XT_EMU_DEVICE_H "' -x c++ ";
    std::string log, pre;
    bool ok = run(common + "-E '" + dir + "/kernel.cpp' -o '" + dir + "/kernel.i'", log) &&
              slurp(dir + "/kernel.i", pre);
    if (ok) {
        // The kernels: extern "C" functions marked by device.h's __global__.
        static const std::regex entry(R"(extern\s+"C"\s+__attribute__\(\(used\)\)\s+void\s+(\w+)\s*\()");
        std::set<std::string> names;
        for (auto it = std::sregex_iterator(pre.begin(), pre.end(), entry);
             it != std::sregex_iterator(); ++it)
            names.insert((*it)[1]);
        std::ofstream out(dir + "/kernel.cpp", std::ios::app);
        out << "\n";
        for (const auto& n : names)
            out << "extern \"C\" __attribute__((visibility(\"default\"))) void xt_emu_thunk_" << n
                << "(void** a) { xt_emu::invoke(&" << n << ", a); }\n";
        out.close();
        ok = run(common + "-O1 -shared '" + dir + "/kernel.cpp' -o '" + dir + "/kernel.so'", log);
    }
    std::string so;
    if (ok) ok = slurp(dir + "/kernel.so", so);
    if (ok) {
        uint64_t len = so.size();
        p.image.assign(MAGIC, MAGIC + 8);
        p.image.insert(p.image.end(), (const char*)&len, (const char*)&len + 8);
        p.image.insert(p.image.end(), so.begin(), so.end());
    } else {
        p.log = p.name + ": the host compiler failed:\n" + log;
    }
    run("rm -rf '" + dir + "'", log);
    return ok ? 0 : 6; // NVRTC_ERROR_COMPILATION
}

} // namespace

// Reported as NVRTC 99.0: the kernel cache keys entries by NVRTC's version, so the emulated
// modules never meet a real NVRTC's cubins there.
API int nvrtcVersion(int* major, int* minor) {
    *major = 99;
    *minor = 0;
    return 0;
}
API const char* nvrtcGetErrorString(int r) {
    return r == 0 ? "NVRTC_SUCCESS" : r == 6 ? "NVRTC_ERROR_COMPILATION" : "NVRTC_ERROR";
}
API int nvrtcCreateProgram(void** prog, const char* src, const char* name, int, const char* const*,
                           const char* const*) {
    *prog = new Program{src, name ? name : "kernel", "", {}};
    return 0;
}
API int nvrtcCompileProgram(void* prog, int, const char* const*) { return compile(*(Program*)prog); }
API int nvrtcGetProgramLogSize(void* prog, size_t* n) {
    *n = ((Program*)prog)->log.size() + 1;
    return 0;
}
API int nvrtcGetProgramLog(void* prog, char* out) {
    const std::string& l = ((Program*)prog)->log;
    memcpy(out, l.c_str(), l.size() + 1);
    return 0;
}
API int nvrtcGetCUBINSize(void* prog, size_t* n) {
    *n = ((Program*)prog)->image.size();
    return 0;
}
API int nvrtcGetCUBIN(void* prog, char* out) {
    const auto& i = ((Program*)prog)->image;
    memcpy(out, i.data(), i.size());
    return 0;
}
API int nvrtcDestroyProgram(void** prog) {
    delete (Program*)*prog;
    *prog = nullptr;
    return 0;
}

// ---- cuBLASLt -----------------------------------------------------------------------------

namespace {

struct Desc {
    int trans_a = 0, trans_b = 0;
};
struct Layout {
    int type;
    uint64_t rows, cols;
    int64_t ld;
};

float load(const void* p, int type, size_t i) {
    switch (type) {
    case 0: return ((const float*)p)[i];
    case 14: return xt_halves::bf16_to_float(((const uint16_t*)p)[i]);
    default: return xt_halves::f16_to_float(((const uint16_t*)p)[i]); // 2: IEEE half
    }
}

// As cuBLASLt writes a NaN: quiet, the sign and top payload kept.
uint16_t to_bf16(float f) {
    return xt_halves::is_nan(f) ? (uint16_t)((xt_halves::bits(f) >> 16) | 0x40u)
                                : xt_halves::to_bf16(f);
}
uint16_t to_f16(float f) {
    return xt_halves::is_nan(f) ? (uint16_t)(((xt_halves::bits(f) >> 16) & 0x8000u) | 0x7e00u)
                                : xt_halves::to_f16(f);
}

void store(void* p, int type, size_t i, float v) {
    switch (type) {
    case 0: ((float*)p)[i] = v; break;
    case 14: ((uint16_t*)p)[i] = to_bf16(v); break;
    default: ((uint16_t*)p)[i] = to_f16(v); break;
    }
}

} // namespace

API int cublasLtCreate(void** h) { static int handle; *h = &handle; return 0; }
API int cublasLtDestroy(void*) { return 0; }
API int cublasLtMatmulDescCreate(void** d, int compute, int scale) {
    if (compute != 68 || scale != 0) return 7; // CUBLAS_STATUS_INVALID_VALUE
    *d = new Desc;
    return 0;
}
API int cublasLtMatmulDescDestroy(void* d) { delete (Desc*)d; return 0; }
API int cublasLtMatmulDescSetAttribute(void* d, int attr, const void* v, size_t size) {
    if (size != 4) return 7;
    int op;
    memcpy(&op, v, 4);
    if (attr == 3) ((Desc*)d)->trans_a = op;
    else if (attr == 4) ((Desc*)d)->trans_b = op;
    else return 7;
    return 0;
}
API int cublasLtMatrixLayoutCreate(void** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    if (type != 0 && type != 2 && type != 14) return 7;
    *l = new Layout{type, rows, cols, ld};
    return 0;
}
API int cublasLtMatrixLayoutDestroy(void* l) { delete (Layout*)l; return 0; }
API int cublasLtMatmulPreferenceCreate(void** p) { static int pref; *p = &pref; return 0; }
API int cublasLtMatmulPreferenceDestroy(void*) { return 0; }
API int cublasLtMatmulPreferenceSetAttribute(void*, int, const void*, size_t) { return 0; }
API int cublasLtMatmulAlgoGetHeuristic(void*, void*, void*, void*, void*, void*, void*, int,
                                       void* result, int* found) {
    memset(result, 0, 96); // cublasLtMatmulHeuristicResult_t
    *found = 1;
    return 0;
}
API int cublasLtMatmul(void*, void* desc, const void* alpha, const void* a, void* la, const void* b,
                       void* lb, const void* beta, const void* c, void* lc, void* d, void* ld,
                       const void*, void*, size_t, void*) {
    const Desc& ds = *(Desc*)desc;
    const Layout &A = *(Layout*)la, &B = *(Layout*)lb, &C = *(Layout*)lc, &D = *(Layout*)ld;
    const uint64_t m = ds.trans_a ? A.cols : A.rows, k = ds.trans_a ? A.rows : A.cols;
    const uint64_t kb = ds.trans_b ? B.cols : B.rows, n = ds.trans_b ? B.rows : B.cols;
    if (k != kb || C.rows != m || C.cols != n || D.rows != m || D.cols != n) return 7;
    const float al = *(const float*)alpha, be = *(const float*)beta;
    // op(A) as m rows of k and op(B) as n rows of k, widened to fp32 (exactly) once.
    std::vector<float> ar(m * k), br(n * k);
    for (uint64_t i = 0; i < m; i++)
        for (uint64_t l = 0; l < k; l++)
            ar[i * k + l] = load(a, A.type, ds.trans_a ? l + i * A.ld : i + l * A.ld);
    for (uint64_t j = 0; j < n; j++)
        for (uint64_t l = 0; l < k; l++)
            br[j * k + l] = load(b, B.type, ds.trans_b ? j + l * B.ld : l + j * B.ld);
    // Each dot product in eight partial sums of doubles (vectorised), added up in a fixed
    // order: the same bits whatever the machine's vector width.
    for (uint64_t j = 0; j < n; j++) {
        const float* bj = &br[j * k];
        for (uint64_t i = 0; i < m; i++) {
            const float* ai = &ar[i * k];
            double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            uint64_t l = 0;
            for (; l + 8 <= k; l += 8)
                for (int q = 0; q < 8; q++) part[q] += (double)ai[l + q] * (double)bj[l + q];
            for (; l < k; l++) part[l % 8] += (double)ai[l] * (double)bj[l];
            const double acc = ((part[0] + part[1]) + (part[2] + part[3])) +
                               ((part[4] + part[5]) + (part[6] + part[7]));
            double v = al * acc;
            if (be != 0) v += (double)be * load(c, C.type, i + j * C.ld);
            store(d, D.type, i + j * D.ld, (float)v);
        }
    }
    return 0;
}

// ---- NCCL ---------------------------------------------------------------------------------

namespace {

struct Comm {
    int nranks;
};

size_t type_bytes(int t) {
    switch (t) {
    case 0: case 1: return 1;      // int8, uint8
    case 6: case 9: return 2;      // half, bfloat16
    case 2: case 3: case 7: return 4; // int32, uint32, float
    default: return 8;             // int64, uint64, double
    }
}

// The sends and receives of the thread's open group (NCCL pairs them when the group ends).
thread_local int group_depth = 0;
thread_local std::vector<std::pair<const void*, size_t>> sends;
thread_local std::vector<std::pair<void*, size_t>> recvs;

int match_sends_and_recvs() {
    if (sends.size() != recvs.size()) {
        fprintf(stderr, "cuda-emu: NCCL group with %zu sends and %zu receives to itself\n",
                sends.size(), recvs.size());
        sends.clear(), recvs.clear();
        return 5; // ncclInvalidUsage
    }
    for (size_t i = 0; i < sends.size(); i++) {
        if (sends[i].second != recvs[i].second) return 5;
        memmove(recvs[i].first, sends[i].first, sends[i].second);
    }
    sends.clear(), recvs.clear();
    return 0;
}

} // namespace

API int ncclGetVersion(int* v) { *v = 22005; return 0; } // NCCL 2.20.5
API int ncclGetUniqueId(void* id) { memset(id, 0x5a, 128); return 0; }
struct UniqueId {
    char bytes[128];
};
API int ncclCommInitRank(void** comm, int nranks, UniqueId, int rank) {
    if (nranks != 1 || rank != 0) {
        fprintf(stderr, "cuda-emu: the emulated NCCL has communicators of one rank only\n");
        return 5;
    }
    *comm = new Comm{nranks};
    return 0;
}
API int ncclCommDestroy(void* comm) { delete (Comm*)comm; return 0; }
API int ncclCommAbort(void* comm) { delete (Comm*)comm; return 0; }
API int ncclCommGetAsyncError(void*, int* e) { *e = 0; return 0; }
API const char* ncclGetErrorString(int r) {
    return r == 0 ? "no error" : r == 5 ? "invalid usage" : "unhandled error";
}
// One rank: every reduction is its own input, every gather and broadcast a copy.
API int ncclAllReduce(const void* s, void* r, size_t n, int t, int, void*, void*) {
    memmove(r, s, n * type_bytes(t));
    return 0;
}
API int ncclReduce(const void* s, void* r, size_t n, int t, int, int root, void*, void*) {
    if (root != 0) return 4;
    memmove(r, s, n * type_bytes(t));
    return 0;
}
API int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, void*, void*) {
    if (root != 0) return 4;
    memmove(r, s, n * type_bytes(t));
    return 0;
}
API int ncclAllGather(const void* s, void* r, size_t n, int t, void*, void*) {
    memmove(r, s, n * type_bytes(t));
    return 0;
}
API int ncclReduceScatter(const void* s, void* r, size_t n, int t, int, void*, void*) {
    memmove(r, s, n * type_bytes(t));
    return 0;
}
API int ncclSend(const void* s, size_t n, int t, int peer, void*, void*) {
    if (peer != 0 || group_depth == 0) return 5;
    sends.emplace_back(s, n * type_bytes(t));
    return 0;
}
API int ncclRecv(void* r, size_t n, int t, int peer, void*, void*) {
    if (peer != 0 || group_depth == 0) return 5;
    recvs.emplace_back(r, n * type_bytes(t));
    return 0;
}
API int ncclGroupStart() { group_depth++; return 0; }
API int ncclGroupEnd() {
    if (group_depth == 0) return 5;
    return --group_depth == 0 ? match_sends_and_recvs() : 0;
}
