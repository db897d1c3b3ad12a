/*
 * A fake libnvidia-ml.so.1 for pytest-gpu's simulated GPUs.
 *
 * It exports the subset of the NVML C API that nvidia-ml-py (pynvml) and the
 * plugin use, with the real signatures, struct layouts, return codes and the
 * two-call size protocol.  Its data comes from the text state file
 * $PYTEST_GPU_SIM_LEDGER/nvml.state that the simulated-GPU ledger rewrites
 * (atomically) on every change; the file is re-read on every device call, so
 * memory and process information is always current.  The format is described
 * in pytest_gpu/sim/nvml/__init__.py.
 *
 * Build: cc -shared -fPIC -O2 -Wl,-soname,libnvidia-ml.so.1 fake_nvml.c
 * With -DFAKE_NVML_NO_V3 the nvmlDevice{Compute,Graphics}RunningProcesses_v3
 * symbols are left out (an older driver, from before both were added).
 *
 * Device handles point into static tables indexed by NVML index (and MIG
 * slot), so a handle stays valid, and keeps naming the same device, for as
 * long as that device is in the state file.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define DRIVER_VERSION "550.54.15"
#define NVML_VERSION "12.550.54.15"
#define CUDA_DRIVER_VERSION 12040

#define MAX_GPUS 64
#define MAX_MIG 7 /* nvmlDeviceGetMaxMigDeviceCount of a MIG-mode GPU */
#define MAX_PROCS 2048
#define STR_LEN 96 /* NVML_DEVICE_UUID_V2_BUFFER_SIZE == NVML_DEVICE_NAME_V2_BUFFER_SIZE */
#define LINE_LEN 512
#define NA_UINT 0xFFFFFFFFu /* NVML_VALUE_NOT_AVAILABLE as unsigned int */
#define NA_ULL 0xFFFFFFFFFFFFFFFFull /* ... as unsigned long long (pynvml reads it as None) */

/* ---- public structs (layouts as in nvml.h) ------------------------------ */

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

typedef struct { /* the unversioned (v1) API's struct */
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct { /* v2 and v3 */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned int version, domain, bus, device, pciDeviceId, pciSubSystemId, baseClass, subClass;
    char busId[32];
} nvmlPciInfoExt_v1_t;
#define nvmlPciInfoExt_v1 ((unsigned int)(sizeof(nvmlPciInfoExt_v1_t) | (1u << 24)))

_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");
_Static_assert(sizeof(nvmlPciInfoExt_v1_t) == 64, "nvmlPciInfoExt_v1_t");

/* ---- the simulated machine ---------------------------------------------- */

struct nvmlDevice_st {
    int present;
    int is_mig;
    unsigned int index; /* NVML index (GPU) or slot (MIG device) */
    struct nvmlDevice_st *parent;
    char uuid[STR_LEN];
    char name[STR_LEN];
    unsigned long long total, reserved, used;
    int mig_mode;       /* GPU only */
    nvmlReturn_t fault; /* GPU only: what handle look-ups return */
};
typedef struct nvmlDevice_st *nvmlDevice_t;

struct proc {
    char uuid[STR_LEN];
    long pid;
    unsigned long long used;
    int graphics; /* a "gfx" line: in the graphics list (its memory is the process's, counted once) */
    int na;       /* listed without its memory: usedGpuMemory NVML_VALUE_NOT_AVAILABLE */
};

struct state {
    unsigned int ngpus;
    long long pidns;
    long long no_usage; /* process lists give usedGpuMemory as not available (Windows WDDM) */
    int other_vendor;   /* "option vendor amd": the machine has no NVIDIA driver */
    struct nvmlDevice_st gpus[MAX_GPUS];
    struct nvmlDevice_st migs[MAX_GPUS][MAX_MIG];
    unsigned int nprocs;
    struct proc procs[MAX_PROCS];
};

static struct state g_state;   /* handles point in here */
static struct state g_scratch; /* parse target, copied over g_state when valid */
static int g_refcount;
static pid_t g_pid; /* who initialised it: a forked child's copy is not initialised (not fork-safe) */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static int parse_fail(const char *path, unsigned int lineno, const char *why) {
    fprintf(stderr, "fake libnvidia-ml: %s:%u: %s\n", path, lineno, why);
    return -1;
}

/* Split off the next space-separated token of *s; NULL when there is none. */
static char *token(char **s) {
    char *p = *s;
    while (*p == ' ') p++;
    if (!*p) return NULL;
    char *start = p;
    while (*p && *p != ' ') p++;
    if (*p) *p++ = '\0';
    *s = p;
    return start;
}

static int parse_ull(const char *t, unsigned long long *out) {
    char *end;
    if (!t || *t == '-') return -1;
    errno = 0;
    *out = strtoull(t, &end, 10);
    return (errno || end == t || *end) ? -1 : 0;
}

static int parse_ll(const char *t, long long *out) {
    char *end;
    if (!t) return -1;
    errno = 0;
    *out = strtoll(t, &end, 10);
    return (errno || end == t || *end) ? -1 : 0;
}

static int copy_field(char *dst, const char *src) {
    if (!src || !*src || strlen(src) >= STR_LEN) return -1;
    strcpy(dst, src);
    return 0;
}

static nvmlReturn_t fault_code(const char *t) {
    if (!strcmp(t, "none")) return NVML_SUCCESS;
    if (!strcmp(t, "no_permission")) return NVML_ERROR_NO_PERMISSION;
    if (!strcmp(t, "gpu_is_lost")) return NVML_ERROR_GPU_IS_LOST;
    return NVML_ERROR_UNKNOWN;
}

/* Read the state file into g_scratch; 0 on success, -1 if missing or malformed. */
static int parse_state(void) {
    const char *dir = getenv("PYTEST_GPU_SIM_LEDGER");
    char path[4096], line[LINE_LEN];
    if (!dir || !*dir) return -1;
    if (snprintf(path, sizeof path, "%s/nvml.state", dir) >= (int)sizeof path) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return -1;

    struct state *s = &g_scratch;
    memset(s, 0, sizeof *s);
    unsigned int lineno = 0;
    int rc = 0;
    while (rc == 0 && fgets(line, sizeof line, f)) {
        lineno++;
        size_t n = strlen(line);
        if (n && line[n - 1] == '\n') line[--n] = '\0';
        else if (!feof(f)) { rc = parse_fail(path, lineno, "line too long"); break; }
        if (n && line[n - 1] == '\r') line[--n] = '\0';
        char *rest = line;
        char *kind = token(&rest);
        if (lineno == 1) {
            if (!kind || strcmp(kind, "v1") || token(&rest)) rc = parse_fail(path, lineno, "expected 'v1'");
            continue;
        }
        if (!kind || kind[0] == '#') continue;
        if (!strcmp(kind, "option")) {
            char *key = token(&rest), *value = token(&rest);
            if (key && !strcmp(key, "pidns") && parse_ll(value, &s->pidns))
                rc = parse_fail(path, lineno, "bad pidns offset");
            else if (key && !strcmp(key, "no_usage") && parse_ll(value, &s->no_usage))
                rc = parse_fail(path, lineno, "bad no_usage flag");
            else if (key && !strcmp(key, "vendor"))
                s->other_vendor = !value || strcmp(value, "nvidia");
        } else if (!strcmp(kind, "gpu")) {
            unsigned long long idx, total, reserved, used, mig;
            char *uuid;
            if (parse_ull(token(&rest), &idx) || idx != s->ngpus || idx >= MAX_GPUS) {
                rc = parse_fail(path, lineno, "gpu lines must come in index order 0..n-1 (at most 64)");
                break;
            }
            struct nvmlDevice_st *d = &s->gpus[idx];
            uuid = token(&rest);
            if (copy_field(d->uuid, uuid) || parse_ull(token(&rest), &total) ||
                parse_ull(token(&rest), &reserved) || parse_ull(token(&rest), &used) ||
                parse_ull(token(&rest), &mig) || mig > 1) {
                rc = parse_fail(path, lineno, "bad gpu line");
                break;
            }
            char *fault = token(&rest);
            while (*rest == ' ') rest++;
            if (!fault || copy_field(d->name, rest)) {
                rc = parse_fail(path, lineno, "bad gpu line (fault or name)");
                break;
            }
            d->present = 1;
            d->index = (unsigned int)idx;
            d->total = total;
            d->reserved = reserved;
            d->used = used;
            d->mig_mode = (int)mig;
            d->fault = fault_code(fault);
            s->ngpus++;
        } else if (!strcmp(kind, "mig")) {
            unsigned long long parent, slot, total, used;
            if (parse_ull(token(&rest), &parent) || parent >= MAX_GPUS || parse_ull(token(&rest), &slot) ||
                slot >= MAX_MIG) {
                rc = parse_fail(path, lineno, "bad mig line (parent index or slot)");
                break;
            }
            struct nvmlDevice_st *m = &s->migs[parent][slot];
            if (m->present || copy_field(m->uuid, token(&rest)) || parse_ull(token(&rest), &total) ||
                parse_ull(token(&rest), &used)) {
                rc = parse_fail(path, lineno, "bad or duplicate mig line");
                break;
            }
            while (*rest == ' ') rest++;
            if (copy_field(m->name, rest)) {
                rc = parse_fail(path, lineno, "bad mig line (name)");
                break;
            }
            m->present = 1;
            m->is_mig = 1;
            m->index = (unsigned int)slot;
            m->total = total;
            m->used = used;
        } else if (!strcmp(kind, "proc") || !strcmp(kind, "gfx")) {
            long long pid;
            unsigned long long used = 0;
            if (s->nprocs >= MAX_PROCS) {
                rc = parse_fail(path, lineno, "too many proc lines");
                break;
            }
            struct proc *p = &s->procs[s->nprocs];
            char *figure = NULL;
            int na = 0;
            if (copy_field(p->uuid, token(&rest)) || parse_ll(token(&rest), &pid) || pid <= 0 ||
                !(figure = token(&rest)) || (!(na = !strcmp(figure, "na")) && parse_ull(figure, &used)) ||
                token(&rest)) {
                rc = parse_fail(path, lineno, "bad proc line");
                break;
            }
            p->pid = (long)pid;
            p->used = used;
            p->na = na;
            p->graphics = !strcmp(kind, "gfx");
            s->nprocs++;
        }
        /* other record kinds: ignored (newer writers) */
    }
    if (rc == 0 && ferror(f)) rc = -1;
    if (rc == 0 && lineno == 0) rc = parse_fail(path, 1, "empty file");
    fclose(f);
    if (rc) return rc;
    for (unsigned int g = 0; g < MAX_GPUS; g++)
        for (unsigned int k = 0; k < MAX_MIG; k++)
            if (s->migs[g][k].present && (g >= s->ngpus || !s->gpus[g].mig_mode))
                return parse_fail(path, lineno, "mig line for a GPU that is not in MIG mode");
    return 0;
}

/* Re-read the state file; on success replace the tables in place (keeping handle identity). */
static int reload(void) {
    if (parse_state()) return -1;
    for (unsigned int g = 0; g < MAX_GPUS; g++) {
        g_scratch.gpus[g].parent = NULL;
        for (unsigned int k = 0; k < MAX_MIG; k++) g_scratch.migs[g][k].parent = &g_state.gpus[g];
    }
    memcpy(&g_state, &g_scratch, sizeof g_state);
    return 0;
}

/* The device a handle names, or NULL for anything that is not a current device's handle. */
static struct nvmlDevice_st *device_of(nvmlDevice_t h) {
    uintptr_t p = (uintptr_t)h, size = sizeof(struct nvmlDevice_st);
    uintptr_t gpus = (uintptr_t)g_state.gpus, migs = (uintptr_t)g_state.migs;
    if (p >= gpus && p < gpus + sizeof g_state.gpus && (p - gpus) % size == 0)
        return h->present ? h : NULL;
    if (p >= migs && p < migs + sizeof g_state.migs && (p - migs) % size == 0)
        return h->present && h->parent->present ? h : NULL;
    return NULL;
}

static struct nvmlDevice_st *gpu_of(struct nvmlDevice_st *d) { return d->is_mig ? d->parent : d; }

/* Lock, require init, refresh the state.  Pair with leave(). */
static nvmlReturn_t enter(void) {
    pthread_mutex_lock(&g_lock);
    if (!g_refcount || g_pid != getpid()) return NVML_ERROR_UNINITIALIZED;
    reload(); /* the file vanishing or going bad keeps the last good state */
    return NVML_SUCCESS;
}

/* enter() plus a valid, reachable device handle. */
static nvmlReturn_t enter_device(nvmlDevice_t h, struct nvmlDevice_st **out) {
    nvmlReturn_t r = enter();
    if (r) return r;
    struct nvmlDevice_st *d = device_of(h);
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    if (gpu_of(d)->fault) return gpu_of(d)->fault;
    *out = d;
    return NVML_SUCCESS;
}

static nvmlReturn_t leave(nvmlReturn_t r) {
    pthread_mutex_unlock(&g_lock);
    return r;
}

static nvmlReturn_t copy_out(char *buf, unsigned int length, const char *value) {
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    if (length < strlen(value) + 1) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, value);
    return NVML_SUCCESS;
}

/* ---- init / shutdown / errors -------------------------------------------- */

static nvmlReturn_t do_init(void) {
    pthread_mutex_lock(&g_lock);
    if (g_pid != getpid()) g_refcount = 0; /* a forked child starts with none of its parent's inits */
    if (reload() && !g_refcount) return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    if (g_state.other_vendor) return leave(NVML_ERROR_DRIVER_NOT_LOADED); /* an AMD machine: no NVIDIA driver */
    g_pid = getpid();
    g_refcount++;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlInit_v2(void) { return do_init(); }
API nvmlReturn_t nvmlInit(void) { return do_init(); }
API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init();
}

API nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    if (!g_refcount || g_pid != getpid()) return leave(NVML_ERROR_UNINITIALIZED);
    g_refcount--;
    return leave(NVML_SUCCESS);
}

API const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case 23: return "Ran out of critical resources, other than memory";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not Ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    default: return "Unknown Error";
    }
}

/* ---- system queries ------------------------------------------------------- */

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t r = enter();
    return leave(r ? r : copy_out(version, length, DRIVER_VERSION));
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    return copy_out(version, length, NVML_VERSION); /* needs no init, as documented */
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = CUDA_DRIVER_VERSION;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ---- device enumeration --------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    nvmlReturn_t r = enter();
    if (r) return leave(r);
    if (!deviceCount) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *deviceCount = g_state.ngpus; /* faulted GPUs count too */
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t r = enter();
    if (r) return leave(r);
    if (!device || index >= g_state.ngpus) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (g_state.gpus[index].fault) return leave(g_state.gpus[index].fault);
    *device = &g_state.gpus[index];
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t r = enter();
    if (r) return leave(r);
    if (!uuid || !device) return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (unsigned int g = 0; g < g_state.ngpus; g++) {
        struct nvmlDevice_st *d = &g_state.gpus[g];
        if (!strcmp(d->uuid, uuid)) {
            if (d->fault) return leave(d->fault);
            *device = d;
            return leave(NVML_SUCCESS);
        }
        for (unsigned int k = 0; k < MAX_MIG; k++) {
            struct nvmlDevice_st *m = &g_state.migs[g][k];
            if (m->present && !strcmp(m->uuid, uuid)) {
                if (d->fault) return leave(d->fault);
                *device = m;
                return leave(NVML_SUCCESS);
            }
        }
    }
    return leave(NVML_ERROR_NOT_FOUND);
}

/* ---- device queries ------------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(device, &d);
    return leave(r ? r : copy_out(uuid, length, d->uuid));
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(device, &d);
    return leave(r ? r : copy_out(name, length, d->name));
}

API nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!index) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *index = d->index; /* a MIG device's index is its slot, as for the real one */
    return leave(NVML_SUCCESS);
}

static unsigned long long minus(unsigned long long a, unsigned long long b) { return a > b ? a - b : 0; }

/* Whether a process still runs: the driver frees a process's memory when it exits, before it is
 * reaped, so a zombie counts as gone (as the ledger's pruning counts it). */
static int alive(long pid) {
    if (kill((pid_t)pid, 0) != 0 && errno != EPERM) return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1; /* no /proc to ask: kill() said it exists */
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *end = strrchr(buf, ')'); /* "pid (comm) state ...": comm may hold spaces and ')' */
    return !(end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X'));
}

/* Used memory of a device less what processes that are gone held there: freed at their exit, while
 * the ledger forgets them only on its next write. */
static unsigned long long live_used(const struct nvmlDevice_st *d) {
    unsigned long long gone = 0;
    for (unsigned int i = 0; i < g_state.nprocs; i++)
        if (!g_state.procs[i].graphics && !strcmp(g_state.procs[i].uuid, d->uuid) && !alive(g_state.procs[i].pid))
            gone += g_state.procs[i].used;
    return minus(d->used, gone);
}

/* total / reserved / used (excluding reserved) of a device, MIG parents aggregated. */
static void memory_of(const struct nvmlDevice_st *d, unsigned long long *total, unsigned long long *reserved,
                      unsigned long long *used) {
    *total = d->total;
    *reserved = d->reserved;
    *used = live_used(d);
    if (!d->is_mig && d->mig_mode) {
        *used = 0;
        for (unsigned int k = 0; k < MAX_MIG; k++) {
            const struct nvmlDevice_st *m = &g_state.migs[d->index][k];
            if (m->present) *used += live_used(m);
        }
    }
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    struct nvmlDevice_st *d = NULL;
    unsigned long long total, reserved, used;
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    memory_of(d, &total, &reserved, &used);
    memory->total = total;
    memory->used = reserved + used;
    memory->free = minus(total, reserved + used);
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    struct nvmlDevice_st *d = NULL;
    unsigned long long total, reserved, used;
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    memory_of(d, &total, &reserved, &used);
    memory->total = total;
    memory->reserved = reserved;
    memory->used = used;
    memory->free = minus(total, reserved + used);
    return leave(NVML_SUCCESS);
}

static void pci_of(const struct nvmlDevice_st *gpu, unsigned int *bus, char *legacy, char *busId) {
    *bus = gpu->index + 1; /* bus 0 is the root complex on real machines */
    snprintf(legacy, 16, "%04X:%02X:%02X.0", 0u, *bus, 0u);
    snprintf(busId, 32, "%08X:%02X:%02X.0", 0u, *bus, 0u);
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!pci) return leave(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    pci_of(gpu_of(d), &pci->bus, pci->busIdLegacy, pci->busId);
    pci->pciDeviceId = 0x233010DE; /* H100 SXM5, NVIDIA vendor id */
    pci->pciSubSystemId = 0x16C110DE;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPciInfoExt(nvmlDevice_t device, nvmlPciInfoExt_v1_t *pci) {
    struct nvmlDevice_st *d = NULL;
    char legacy[16];
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!pci) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (pci->version != nvmlPciInfoExt_v1) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    pci->domain = 0;
    pci->device = 0;
    pci_of(gpu_of(d), &pci->bus, legacy, pci->busId);
    pci->pciDeviceId = 0x233010DE;
    pci->pciSubSystemId = 0x16C110DE;
    pci->baseClass = 3; /* display controller */
    pci->subClass = 2;  /* 3D controller */
    return leave(NVML_SUCCESS);
}

/* ---- MIG ------------------------------------------------------------------ */

API nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!currentMode || !pendingMode) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (d->is_mig) return leave(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = *pendingMode = (unsigned int)d->mig_mode;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!count || d->is_mig) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *count = d->mig_mode ? MAX_MIG : 0;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                     nvmlDevice_t *migDevice) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!migDevice || d->is_mig) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!d->mig_mode) return leave(NVML_ERROR_NOT_SUPPORTED);
    if (index >= MAX_MIG) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!g_state.migs[d->index][index].present) return leave(NVML_ERROR_NOT_FOUND);
    *migDevice = &g_state.migs[d->index][index];
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!isMigDevice) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = (unsigned int)d->is_mig;
    return leave(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(migDevice, &d);
    if (r) return leave(r);
    if (!device || !d->is_mig) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *device = d->parent;
    return leave(NVML_SUCCESS);
}

/* ---- running processes ---------------------------------------------------- */

/* The two-call protocol shared by every *RunningProcesses* symbol; stride tells v1 from v2/v3 structs. */
static nvmlReturn_t running(nvmlDevice_t device, unsigned int *infoCount, void *infos, size_t stride,
                            int graphics) {
    struct nvmlDevice_st *d = NULL;
    nvmlReturn_t r = enter_device(device, &d);
    if (r) return leave(r);
    if (!infoCount || (!infos && *infoCount)) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!graphics && (d->is_mig || d->mig_mode)) return leave(NVML_ERROR_NO_PERMISSION); /* unprivileged, MIG */
    unsigned int n = 0;
    for (unsigned int i = 0; i < g_state.nprocs; i++)
        n += g_state.procs[i].graphics == graphics && !strcmp(g_state.procs[i].uuid, d->uuid) &&
             alive(g_state.procs[i].pid);
    if (n == 0) {
        *infoCount = 0;
        return leave(NVML_SUCCESS);
    }
    if (!infos || *infoCount < n) {
        *infoCount = n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    unsigned int out = 0;
    for (unsigned int i = 0; i < g_state.nprocs && out < n; i++) {
        const struct proc *p = &g_state.procs[i];
        if (p->graphics != graphics || strcmp(p->uuid, d->uuid) || !alive(p->pid)) continue;
        char *slot = (char *)infos + out++ * stride;
        /* a process's usage is all it holds on the device, its context included, whoever it works for */
        unsigned long long used = g_state.no_usage || p->na ? NA_ULL : p->used;
        nvmlProcessInfo_t info = {(unsigned int)(p->pid + g_state.pidns), used, NA_UINT, NA_UINT};
        if (stride == sizeof(nvmlProcessInfo_t)) {
            memcpy(slot, &info, sizeof info);
        } else {
            nvmlProcessInfo_v1_t v1 = {info.pid, info.usedGpuMemory};
            memcpy(slot, &v1, sizeof v1);
        }
    }
    *infoCount = out;
    return leave(NVML_SUCCESS);
}

#ifndef FAKE_NVML_NO_V3
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos) {
    return running(device, infoCount, infos, sizeof *infos, 0);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                          nvmlProcessInfo_t *infos) {
    return running(device, infoCount, infos, sizeof *infos, 1);
}
#endif

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos) {
    return running(device, infoCount, infos, sizeof *infos, 0);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_v1_t *infos) {
    return running(device, infoCount, infos, sizeof *infos, 0);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                          nvmlProcessInfo_t *infos) {
    return running(device, infoCount, infos, sizeof *infos, 1);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                       nvmlProcessInfo_v1_t *infos) {
    return running(device, infoCount, infos, sizeof *infos, 1);
}
