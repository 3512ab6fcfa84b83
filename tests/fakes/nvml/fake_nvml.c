/* A fake libnvidia-ml.so.1 for tests: the real nvidia-ml-py (pynvml) loads
 * it through LD_LIBRARY_PATH (pynvml calls CDLL("libnvidia-ml.so.1")) and
 * gets a simulated node. Our own code, written from the NVML API facts in
 * docs (docs/reference/mps-nvml.md section 4); no upstream code.
 *
 * Node file: $FAKE_NVML_NODE, read at every nvmlInitWithFlags. One record a
 * line, fields separated by single spaces ('#' starts a comment line):
 *
 *   driver <version string>                 e.g. driver 615.71.09
 *   cuda <int>                               e.g. cuda 13040
 *   gpu <index> <uuid> <minor> <pci bus id> <memory bytes> <numa> <cc major> <cc minor> <mig 0|1> <name...>
 *   proc <gpu index> <pid> <used bytes>      a compute process
 *   util <gpu index> <pid> <sm percent>      a process utilisation sample
 *   xid <gpu index> <code>                   delivered once by nvmlEventSetWait_v2
 *   fail <function> <uuid|*> <nvml code>     that call on that GPU returns the code
 *                                            (functions: SetMemoryLimits, GetMemoryLimits,
 *                                            GetHandleByUUID, MemoryInfo, Init)
 *
 * Memory limits: $FAKE_NVML_LIMITS (a journal file: one line appended per
 * nvmlDeviceSetMemoryLimits_v1, "<uuid> <soft bytes> <hard bytes> <namespace>",
 * the last line of a (GPU, namespace) wins), under flock, read incrementally by
 * nvmlDeviceGetMemoryLimits_v1, so tests (and several processes) see one
 * state. A namespace that is not an existing directory is NVML_ERROR_NOT_FOUND;
 * a GPU in MIG mode is NVML_ERROR_NOT_SUPPORTED (NVML rejects MIG); "no limit"
 * (soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX) removes the line.
 * Parents' reservations, as NVIDIA states them (Dynamo docs, "Per-GPU Compute and
 * Memory Limits with MPS"; docs/adr/0036): "The driver adds each soft limit to the
 * parent cgroups' reservations. Deleting a cgroup without zeroing its soft limit
 * leaves that reservation on the parents." Modelled so: the softLimit that
 * nvmlDeviceGetMemoryLimits_v1 reads on a cgroup is its own soft limit plus the soft
 * limits of every entry set on a path below it, including paths whose directory is
 * gone (a leaf deleted without zeroing); the deleted leaf's own entry is not readable
 * (NOT_FOUND). That a real read of a parent reports its reservation this way is an
 * inference (docs/adr/0036); a cgroup re-made at a deleted one's path is not modelled.
 * $FAKE_NVML_CALLS, when set, gets one line appended per Set/Get call
 * ("set|get <uuid> <namespace>") so tests can count NVML calls.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

enum {
    OK = 0, UNINITIALIZED = 1, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3, NO_PERMISSION = 4,
    NOT_FOUND = 6, INSUFFICIENT_SIZE = 7, TIMEOUT = 10, UNKNOWN = 999
};

#define MAX_GPUS 16
#define MAX_PROCS 64
#define MAX_FAILS 32
#define LIMIT_MAX 0xFFFFFFFFFFFFFFFFULL

typedef struct {
    unsigned index, minor, mig, numa_set;
    int numa, cc_major, cc_minor;
    unsigned compute_mode;
    unsigned long long memory;
    char uuid[96], pci[32], name[96];
} gpu_t;

typedef struct { unsigned gpu, pid; unsigned long long used; } proc_t;
typedef struct { unsigned gpu, pid, sm; } util_t;
typedef struct { unsigned gpu; unsigned long long code; int delivered; } xid_t;
typedef struct { char fn[32]; char uuid[96]; int code; } fail_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int refcount;
static char driver[80] = "615.71.09";
static int cuda = 13040;
static gpu_t gpus[MAX_GPUS];
static unsigned ngpus;
static proc_t procs[MAX_PROCS];
static unsigned nprocs;
static util_t utils[MAX_PROCS];
static unsigned nutils;
static xid_t xids[MAX_PROCS];
static unsigned nxids;
static fail_t fails[MAX_FAILS];
static unsigned nfails;

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct { unsigned pid; unsigned long long usedGpuMemory; unsigned gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
typedef struct { unsigned pid; unsigned long long timeStamp; unsigned smUtil, memUtil, encUtil, decUtil; } nvmlProcessUtilizationSample_t;
typedef struct { nvmlDevice_t device; unsigned long long eventType, eventData; unsigned gpuInstanceId, computeInstanceId; } nvmlEventData_t;
typedef struct { const char *nameSpace; unsigned long long softLimit, hardLimit; } nvmlSetMemoryLimits_v1_t;
typedef struct { const char *nameSpace; unsigned long long softLimit, hardLimit, currentUsed; } nvmlGetMemoryLimits_v1_t;
typedef struct nvmlEventSet_st { int unused; } *nvmlEventSet_t;

static int failure(const char *fn, const char *uuid) {
    for (unsigned i = 0; i < nfails; i++)
        if (!strcmp(fails[i].fn, fn) && (!strcmp(fails[i].uuid, "*") || (uuid && !strcmp(fails[i].uuid, uuid))))
            return fails[i].code;
    return OK;
}

static int load_node(void) {
    const char *path = getenv("FAKE_NVML_NODE");
    ngpus = nprocs = nutils = nxids = nfails = 0;
    if (!path) return OK;
    FILE *f = fopen(path, "r");
    if (!f) return UNKNOWN;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (line[0] == '#' || !line[0]) continue;
        if (!strncmp(line, "driver ", 7)) {
            snprintf(driver, sizeof driver, "%s", line + 7);
        } else if (!strncmp(line, "cuda ", 5)) {
            cuda = atoi(line + 5);
        } else if (!strncmp(line, "gpu ", 4) && ngpus < MAX_GPUS) {
            gpu_t *g = &gpus[ngpus];
            memset(g, 0, sizeof *g);
            int off = 0;
            if (sscanf(line + 4, "%u %95s %u %31s %llu %d %d %d %u %n", &g->index, g->uuid, &g->minor, g->pci,
                       &g->memory, &g->numa, &g->cc_major, &g->cc_minor, &g->mig, &off) >= 9) {
                snprintf(g->name, sizeof g->name, "%s", line + 4 + off);
                g->numa_set = g->numa >= 0;
                ngpus++;
            }
        } else if (!strncmp(line, "proc ", 5) && nprocs < MAX_PROCS) {
            if (sscanf(line + 5, "%u %u %llu", &procs[nprocs].gpu, &procs[nprocs].pid, &procs[nprocs].used) == 3) nprocs++;
        } else if (!strncmp(line, "util ", 5) && nutils < MAX_PROCS) {
            if (sscanf(line + 5, "%u %u %u", &utils[nutils].gpu, &utils[nutils].pid, &utils[nutils].sm) == 3) nutils++;
        } else if (!strncmp(line, "xid ", 4) && nxids < MAX_PROCS) {
            if (sscanf(line + 4, "%u %llu", &xids[nxids].gpu, &xids[nxids].code) == 2) xids[nxids++].delivered = 0;
        } else if (!strncmp(line, "fail ", 5) && nfails < MAX_FAILS) {
            if (sscanf(line + 5, "%31s %95s %d", fails[nfails].fn, fails[nfails].uuid, &fails[nfails].code) == 3) nfails++;
        }
    }
    fclose(f);
    return OK;
}

static gpu_t *dev(nvmlDevice_t d) {
    gpu_t *g = (gpu_t *)d;
    if (!refcount || g < gpus || g >= gpus + ngpus) return NULL;
    return g;
}

#define DEV(g, d) gpu_t *g = dev(d); if (!g) return refcount ? INVALID_ARGUMENT : UNINITIALIZED

static int copy_str(char *out, unsigned len, const char *s) {
    if (!out) return INVALID_ARGUMENT;
    if (strlen(s) + 1 > len) return INSUFFICIENT_SIZE;
    memcpy(out, s, strlen(s) + 1);
    return OK;
}

API const char *nvmlErrorString(int result) {
    switch (result) {
    case OK: return "Success";
    case UNINITIALIZED: return "Uninitialized";
    case INVALID_ARGUMENT: return "Invalid Argument";
    case NOT_SUPPORTED: return "Not Supported";
    case NO_PERMISSION: return "Insufficient Permissions";
    case NOT_FOUND: return "Not Found";
    case INSUFFICIENT_SIZE: return "Insufficient Size";
    case TIMEOUT: return "Timeout";
    default: return "Unknown Error";
    }
}

API int nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    pthread_mutex_lock(&mu);
    int rc = OK;
    if (refcount == 0) rc = load_node();
    if (rc == OK) rc = failure("Init", "*");
    if (rc == OK) refcount++;
    pthread_mutex_unlock(&mu);
    return rc;
}
API int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
API int nvmlInit(void) { return nvmlInitWithFlags(0); }

API int nvmlShutdown(void) {
    pthread_mutex_lock(&mu);
    int rc = refcount ? OK : UNINITIALIZED;
    if (refcount) refcount--;
    pthread_mutex_unlock(&mu);
    return rc;
}

API int nvmlSystemGetDriverVersion(char *out, unsigned len) {
    if (!refcount) return UNINITIALIZED;
    return copy_str(out, len, driver);
}

API int nvmlSystemGetCudaDriverVersion(int *out) { if (!out) return INVALID_ARGUMENT; *out = cuda; return OK; }
API int nvmlSystemGetCudaDriverVersion_v2(int *out) { return nvmlSystemGetCudaDriverVersion(out); }

API int nvmlDeviceGetCount_v2(unsigned *n) {
    if (!refcount) return UNINITIALIZED;
    if (!n) return INVALID_ARGUMENT;
    *n = ngpus;
    return OK;
}
API int nvmlDeviceGetCount(unsigned *n) { return nvmlDeviceGetCount_v2(n); }

API int nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *out) {
    if (!refcount) return UNINITIALIZED;
    if (!out || i >= ngpus) return INVALID_ARGUMENT;
    *out = (nvmlDevice_t)&gpus[i];
    return OK;
}
API int nvmlDeviceGetHandleByIndex(unsigned i, nvmlDevice_t *out) { return nvmlDeviceGetHandleByIndex_v2(i, out); }

API int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *out) {
    if (!refcount) return UNINITIALIZED;
    if (!uuid || !out) return INVALID_ARGUMENT;
    int rc = failure("GetHandleByUUID", uuid);
    if (rc) return rc;
    for (unsigned i = 0; i < ngpus; i++)
        if (!strcmp(gpus[i].uuid, uuid)) { *out = (nvmlDevice_t)&gpus[i]; return OK; }
    return NOT_FOUND;
}

API int nvmlDeviceGetUUID(nvmlDevice_t d, char *out, unsigned len) { DEV(g, d); return copy_str(out, len, g->uuid); }
API int nvmlDeviceGetName(nvmlDevice_t d, char *out, unsigned len) { DEV(g, d); return copy_str(out, len, g->name); }
API int nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *out) { DEV(g, d); *out = g->index; return OK; }
API int nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned *out) { DEV(g, d); *out = g->minor; return OK; }

API int nvmlDeviceGetNumaNodeId(nvmlDevice_t d, int *out) {
    DEV(g, d);
    if (!g->numa_set) return NOT_SUPPORTED;
    *out = g->numa;
    return OK;
}

API int nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor) {
    DEV(g, d);
    *major = g->cc_major;
    *minor = g->cc_minor;
    return OK;
}

API int nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned *current, unsigned *pending) {
    DEV(g, d);
    *current = g->mig;
    *pending = g->mig;
    return OK;
}

API int nvmlDeviceGetComputeMode(nvmlDevice_t d, unsigned *mode) { DEV(g, d); *mode = g->compute_mode; return OK; }
API int nvmlDeviceSetComputeMode(nvmlDevice_t d, unsigned mode) { DEV(g, d); g->compute_mode = mode; return OK; }

static unsigned long long used_on(unsigned gpu) {
    unsigned long long used = 0;
    for (unsigned i = 0; i < nprocs; i++)
        if (procs[i].gpu == gpu) used += procs[i].used;
    return used;
}

API int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    DEV(g, d);
    int rc = failure("MemoryInfo", g->uuid);
    if (rc) return rc;
    m->total = g->memory;
    m->used = used_on(g->index);
    m->free = m->total > m->used ? m->total - m->used : 0;
    return OK;
}

API int nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *p) {
    DEV(g, d);
    memset(p, 0, sizeof *p);
    snprintf(p->busId, sizeof p->busId, "%s", g->pci);
    snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "%s", g->pci + (strlen(g->pci) > 12 ? 4 : 0));
    unsigned dom = 0, bus = 0, dv = 0;
    if (sscanf(g->pci, "%x:%x:%x", &dom, &bus, &dv) == 3) { p->domain = dom; p->bus = bus; p->device = dv; }
    p->pciDeviceId = 0x233010de;
    return OK;
}

static int list_procs(nvmlDevice_t d, unsigned *count, nvmlProcessInfo_t *infos) {
    DEV(g, d);
    if (!count) return INVALID_ARGUMENT;
    unsigned n = 0;
    for (unsigned i = 0; i < nprocs; i++) n += procs[i].gpu == g->index;
    if (n == 0) { *count = 0; return OK; }
    if (!infos || *count < n) { *count = n; return INSUFFICIENT_SIZE; }
    unsigned k = 0;
    for (unsigned i = 0; i < nprocs; i++) {
        if (procs[i].gpu != g->index) continue;
        infos[k].pid = procs[i].pid;
        infos[k].usedGpuMemory = procs[i].used;
        infos[k].gpuInstanceId = infos[k].computeInstanceId = 0xFFFFFFFFu;
        k++;
    }
    *count = k;
    return OK;
}
API int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p) { return list_procs(d, c, p); }
API int nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p) { return list_procs(d, c, p); }
API int nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *c, nvmlProcessInfo_t *p) {
    DEV(g, d);
    (void)g; (void)p;
    if (!c) return INVALID_ARGUMENT;
    *c = 0;  /* the same processes are listed once, as compute processes */
    return OK;
}

static unsigned long long now_us(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (unsigned long long)tv.tv_sec * 1000000ULL + (unsigned long long)tv.tv_usec;
}

API int nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *s, unsigned *count,
                                        unsigned long long last_seen) {
    DEV(g, d);
    (void)last_seen;
    if (!count) return INVALID_ARGUMENT;
    unsigned n = 0;
    for (unsigned i = 0; i < nutils; i++) n += utils[i].gpu == g->index;
    if (n == 0) return NOT_FOUND;
    if (!s || *count < n) { *count = n; return INSUFFICIENT_SIZE; }
    unsigned k = 0;
    unsigned long long ts = now_us();
    for (unsigned i = 0; i < nutils; i++) {
        if (utils[i].gpu != g->index) continue;
        memset(&s[k], 0, sizeof s[k]);
        s[k].pid = utils[i].pid;
        s[k].smUtil = utils[i].sm;
        s[k].timeStamp = ts;
        k++;
    }
    *count = k;
    return OK;
}

static struct nvmlEventSet_st the_set;

API int nvmlEventSetCreate(nvmlEventSet_t *es) { if (!refcount) return UNINITIALIZED; *es = &the_set; return OK; }
API int nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long mask, nvmlEventSet_t es) {
    DEV(g, d);
    (void)g; (void)mask; (void)es;
    return OK;
}
API int nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) { DEV(g, d); (void)g; *types = 0x8; return OK; }
API int nvmlEventSetFree(nvmlEventSet_t es) { (void)es; return OK; }

API int nvmlEventSetWait_v2(nvmlEventSet_t es, nvmlEventData_t *data, unsigned timeout_ms) {
    (void)es;
    if (!refcount) return UNINITIALIZED;
    pthread_mutex_lock(&mu);
    for (unsigned i = 0; i < nxids; i++) {
        if (xids[i].delivered || xids[i].gpu >= ngpus) continue;
        xids[i].delivered = 1;
        memset(data, 0, sizeof *data);
        data->device = (nvmlDevice_t)&gpus[xids[i].gpu];
        data->eventType = 0x8;
        data->eventData = xids[i].code;
        data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
        pthread_mutex_unlock(&mu);
        return OK;
    }
    pthread_mutex_unlock(&mu);
    /* no event: wait out the timeout in short steps, as the driver would */
    unsigned waited = 0;
    while (waited < timeout_ms) {
        unsigned step = timeout_ms - waited < 50 ? timeout_ms - waited : 50;
        struct timespec ts = {0, (long)step * 1000000L};
        nanosleep(&ts, NULL);
        waited += step;
    }
    return TIMEOUT;
}

/* ------------------------------------------------------------ memory limits */

static void log_call(const char *what, const char *uuid, const char *ns) {
    const char *path = getenv("FAKE_NVML_CALLS");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s %s %s\n", what, uuid, ns);
    fclose(f);
}

/* The limits file is a journal: one line per Set ("<uuid> <soft> <hard> <ns>"),
 * the last line of a (uuid, ns) wins, soft 0 + hard MAX clears it. Each process
 * keeps the table it has read so far and reads only what was appended since
 * (so a call costs O(new lines), as the driver's O(1), not O(all limits)); a
 * file that shrank or was replaced is read again from the start. */
typedef struct { char uuid[96]; char *ns; unsigned long long soft, hard; } limit_t;
static limit_t *table;
static size_t nlimits, cap_limits;
static char table_path[4096];
static dev_t table_dev;
static ino_t table_ino;
static off_t table_seen;
static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;

static void table_reset(void) {
    for (size_t i = 0; i < nlimits; i++) free(table[i].ns);
    nlimits = 0;
    table_seen = 0;
}

static limit_t *table_find(const char *uuid, const char *ns) {
    for (size_t i = 0; i < nlimits; i++)
        if (!strcmp(table[i].uuid, uuid) && !strcmp(table[i].ns, ns)) return &table[i];
    return NULL;
}

static int table_put(const char *uuid, const char *ns, unsigned long long soft, unsigned long long hard) {
    limit_t *e = table_find(uuid, ns);
    if (soft == 0 && hard == LIMIT_MAX) {
        if (e) {
            free(e->ns);
            *e = table[--nlimits];
        }
        return OK;
    }
    if (!e) {
        if (nlimits == cap_limits) {
            size_t cap = cap_limits ? cap_limits * 2 : 64;
            limit_t *t = realloc(table, cap * sizeof *t);
            if (!t) return UNKNOWN;
            table = t;
            cap_limits = cap;
        }
        e = &table[nlimits];
        snprintf(e->uuid, sizeof e->uuid, "%s", uuid);
        e->ns = strdup(ns);
        if (!e->ns) return UNKNOWN;
        nlimits++;
    }
    e->soft = soft;
    e->hard = hard;
    return OK;
}

/* Bring the table up to date with the journal at fd (the caller holds a flock). */
static int table_sync(int fd, const char *path) {
    struct stat st;
    if (fstat(fd, &st) != 0) return UNKNOWN;
    if (strcmp(path, table_path) || st.st_dev != table_dev || st.st_ino != table_ino || st.st_size < table_seen) {
        table_reset();
        snprintf(table_path, sizeof table_path, "%s", path);
        table_dev = st.st_dev;
        table_ino = st.st_ino;
    }
    if (st.st_size == table_seen) return OK;
    size_t len = (size_t)(st.st_size - table_seen);
    char *buf = malloc(len + 1);
    if (!buf) return UNKNOWN;
    ssize_t n = pread(fd, buf, len, table_seen);
    if (n < 0) { free(buf); return UNKNOWN; }
    buf[n] = 0;
    char *line = buf, *nl;
    while ((nl = strchr(line, '\n')) != NULL) {  /* complete lines only */
        *nl = 0;
        char uuid[96];
        unsigned long long soft, hard;
        int off = 0;
        if (sscanf(line, "%95s %llu %llu %n", uuid, &soft, &hard, &off) >= 3 && off > 0)
            table_put(uuid, line + off, soft, hard);
        table_seen += (off_t)(nl - line + 1);
        line = nl + 1;
    }
    free(buf);
    return OK;
}

/* Open the journal locked (LOCK_EX to append, LOCK_SH to read) and sync the
 * table; -1 when $FAKE_NVML_LIMITS is unset or cannot be opened. */
static int open_limits(int exclusive, int *rc) {
    const char *path = getenv("FAKE_NVML_LIMITS");
    *rc = OK;
    if (!path) return -1;
    int fd = open(path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) { *rc = UNKNOWN; return -1; }
    if (flock(fd, exclusive ? LOCK_EX : LOCK_SH) != 0) { close(fd); *rc = UNKNOWN; return -1; }
    *rc = table_sync(fd, path);
    return fd;
}

static int check_limits_call(gpu_t *g, const char *fn, const char *ns) {
    int rc = failure(fn, g->uuid);
    if (rc) return rc;
    if (g->mig) return NOT_SUPPORTED;
    if (!ns || !ns[0]) return INVALID_ARGUMENT;
    struct stat st;
    if (stat(ns, &st) != 0 || !S_ISDIR(st.st_mode)) return NOT_FOUND;
    return OK;
}

API int nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t d, nvmlGetMemoryLimits_v1_t *lim) {
    DEV(g, d);
    if (!lim) return INVALID_ARGUMENT;
    log_call("get", g->uuid, lim->nameSpace ? lim->nameSpace : "");
    int rc = check_limits_call(g, "GetMemoryLimits", lim->nameSpace);
    if (rc) return rc;
    lim->softLimit = 0;
    lim->hardLimit = LIMIT_MAX;
    lim->currentUsed = 0;
    pthread_mutex_lock(&table_mu);
    int fd = open_limits(0, &rc);
    if (rc == OK) {
        limit_t *e = table_find(g->uuid, lim->nameSpace);
        if (e) {
            lim->softLimit = e->soft;
            lim->hardLimit = e->hard;
        }
        size_t n = strlen(lim->nameSpace);
        while (n > 1 && lim->nameSpace[n - 1] == '/') n--;
        for (size_t i = 0; i < nlimits; i++)  /* the reservation: soft limits set below it */
            if (!strcmp(table[i].uuid, g->uuid) && !strncmp(table[i].ns, lim->nameSpace, n) && table[i].ns[n] == '/')
                lim->softLimit += table[i].soft;
    }
    if (fd >= 0) close(fd);
    pthread_mutex_unlock(&table_mu);
    return rc;
}

API int nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t d, const nvmlSetMemoryLimits_v1_t *lim) {
    DEV(g, d);
    if (!lim) return INVALID_ARGUMENT;
    log_call("set", g->uuid, lim->nameSpace ? lim->nameSpace : "");
    int rc = check_limits_call(g, "SetMemoryLimits", lim->nameSpace);
    if (rc) return rc;
    if (lim->hardLimit != LIMIT_MAX && lim->softLimit > lim->hardLimit) return INVALID_ARGUMENT;
    pthread_mutex_lock(&table_mu);
    int fd = open_limits(1, &rc);
    if (fd < 0 && rc == OK) rc = UNKNOWN;  /* nowhere to keep it */
    if (rc == OK) {
        char line[8192];
        int n = snprintf(line, sizeof line, "%s %llu %llu %s\n", g->uuid, lim->softLimit, lim->hardLimit,
                         lim->nameSpace);
        if (n <= 0 || (size_t)n >= sizeof line || write(fd, line, (size_t)n) != n) {
            rc = UNKNOWN;
        } else {
            table_seen += n;  /* our own line, already applied below */
            rc = table_put(g->uuid, lim->nameSpace, lim->softLimit, lim->hardLimit);
        }
    }
    if (fd >= 0) close(fd);
    pthread_mutex_unlock(&table_mu);
    return rc;
}
