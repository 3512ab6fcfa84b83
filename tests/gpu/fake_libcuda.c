/* A stand-in for libcuda.so.1 with the few CUDA driver API entry points
 * tests/gpu/cuda_client.py calls, for rehearsing `make gpu-check` on a machine
 * without a GPU (tests/component/test_gpu_check_sim.py builds it with cc).
 * It is NOT a model of MPS: it only reads the env a real client gets, so the
 * check's plumbing (ctypes signatures, env from the plan, report) runs end to end.
 *
 *   devices        entries of CUDA_VISIBLE_DEVICES, else FAKE_CUDA_DEVICES (default 4)
 *   UUID of dev 0  the first GPU-... entry of CUDA_VISIBLE_DEVICES / NVIDIA_VISIBLE_DEVICES
 *   SMs            132; the context gets floor(132 * CUDA_MPS_ACTIVE_THREAD_PERCENTAGE / 100)
 *   MPS enabled    1 when $CUDA_MPS_PIPE_DIRECTORY/control exists
 *   memory         80 GiB; cuMemAlloc fails (CUDA_ERROR_OUT_OF_MEMORY, 2) past
 *                  the first entry of CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("<ordinal or UUID>=<n>M|G",
 *                  fracplugin writes the UUID) less 300 MiB of context
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MIB (1024ull * 1024ull)
static unsigned long long used = 300 * MIB;
static uint64_t next_ptr = 0x10000000ull;

static int count_list(const char *s) {
    int n = 1;
    for (; *s; s++) n += (*s == ',');
    return n;
}

int cuInit(unsigned int flags) { (void)flags; return 0; }

int cuDeviceGetCount(int *n) {
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    const char *fake = getenv("FAKE_CUDA_DEVICES");
    *n = (cvd && *cvd) ? count_list(cvd) : (fake ? atoi(fake) : 4);
    return 0;
}

int cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return 0; }

int cuDeviceGetUuid_v2(unsigned char *uuid, int dev) {
    const char *src = getenv("CUDA_VISIBLE_DEVICES");
    if (!src || strncmp(src, "GPU-", 4) != 0) src = getenv("NVIDIA_VISIBLE_DEVICES");
    memset(uuid, 0, 16);
    uuid[15] = (unsigned char)dev;
    if (dev == 0 && src && strncmp(src, "GPU-", 4) == 0) {
        int i = 0;
        for (const char *p = src + 4; *p && *p != ',' && i < 16;) {
            if (*p == '-') { p++; continue; }
            unsigned int b;
            if (sscanf(p, "%2x", &b) != 1) break;
            uuid[i++] = (unsigned char)b;
            p += 2;
        }
    }
    return 0;
}

static int sm_ctx(void) {
    const char *atp = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
    int pct = atp ? atoi(atp) : 100;
    if (pct < 1 || pct > 100) pct = 100;
    return 132 * pct / 100;
}

int cuDeviceGetAttribute(int *v, int attr, int dev) {
    (void)dev;
    if (attr == 16) { *v = 132; return 0; }
    if (attr == 133) {
        char path[4096];
        const char *pipe = getenv("CUDA_MPS_PIPE_DIRECTORY");
        snprintf(path, sizeof path, "%s/control", pipe ? pipe : "/tmp/nvidia-mps");
        *v = access(path, F_OK) == 0;
        return 0;
    }
    return 1; /* CUDA_ERROR_INVALID_VALUE */
}

int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)(uintptr_t)(dev + 1); return 0; }
int cuCtxSetCurrent(void *ctx) { (void)ctx; return 0; }
int cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return 0; }

int cuCtxGetExecAffinity(unsigned int *param, int type) {
    if (type != 0) return 1;
    param[0] = 0;
    param[1] = (unsigned int)sm_ctx();
    return 0;
}

static unsigned long long limit_bytes(void) {
    const char *s = getenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT");
    unsigned long long n;
    char unit = 'M';
    if (s) s = strchr(s, '=');
    if (s && sscanf(s, "=%llu%c", &n, &unit) >= 1) return n * (unit == 'G' ? 1024 : 1) * MIB;
    return 80ull * 1024 * MIB;
}

int cuMemGetInfo_v2(size_t *free_b, size_t *total) {
    *total = 80ull * 1024 * MIB;
    *free_b = *total - used;
    return 0;
}

int cuMemAlloc_v2(uint64_t *ptr, size_t n) {
    if (used + n > limit_bytes()) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    used += n;
    *ptr = next_ptr;
    next_ptr += n;
    return 0;
}

int cuMemFree_v2(uint64_t ptr) { (void)ptr; return 0; }

int cuGetErrorName(int code, const char **name) {
    *name = code == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : code == 1 ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN";
    return 0;
}
