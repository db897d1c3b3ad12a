/*
 * A fake Level Zero loader (libze_loader.so.1) for pytest-gpu's simulated Intel GPUs: the part
 * of Sysman (zes_api.h) that pytest_gpu.vendors.intel calls through ctypes.
 *
 * Signatures, struct layouts, structure types and result codes follow oneapi-src/level-zero's
 * include/zes_api.h and include/ze_api.h at d3b3efbdaa27a0aef9a9812cc8fa4260557c1e7c:
 * zesInit (flags must be 0 or 1: ZE_RESULT_ERROR_INVALID_ENUMERATION above), zesDriverGet and
 * zesDeviceGet with the two-call count protocol (a count of 0 asks for the number; a larger
 * one is lowered to it; a smaller one fills that many), zesDeviceGetProperties,
 * zesDeviceEnumMemoryModules, zesMemoryGetState (free and size in bytes) and
 * zesDeviceProcessesGetState (memSize in bytes; a buffer too small for every process fills
 * what fits and answers ZE_RESULT_ERROR_INVALID_SIZE). Before zesInit every call answers
 * ZE_RESULT_ERROR_UNINITIALIZED; a null handle ZE_RESULT_ERROR_INVALID_NULL_HANDLE, a null
 * count or struct ZE_RESULT_ERROR_INVALID_NULL_POINTER, and a handle that names no device or
 * module of this library ZE_RESULT_ERROR_INVALID_ARGUMENT (the real loader's validation layer
 * is off by default, where such a handle is undefined behaviour: here it is refused).
 * Without an Intel machine (no state file, or another vendor's), zesInit answers
 * ZE_RESULT_ERROR_UNINITIALIZED, as the loader does when it finds no driver.
 *
 * Data: $PYTEST_GPU_SIM_LEDGER/nvml.state (format: pytest_gpu/sim/nvml/__init__.py) with
 * "option vendor xpu", re-read on every call. A GPU's UUID there is the 36-character form
 * (8-4-4-4-12 hex digits) of the 16 bytes zesDeviceGetProperties gives in core.uuid. Each
 * device has one memory module (HBM) whose size is the GPU's total less the driver's reserve
 * and whose free memory is that less what is used. Processes that are gone are not listed.
 * Devices have no sub-devices (numSubdevices 0): the fake models single-tile cards.
 *
 * The core API's device list (ze_api.h: zeInit, zeDriverGet, zeDeviceGet, zeDeviceGetProperties),
 * which the runtime a test process uses (torch's SYCL) enumerates, and which pytest-gpu pins and
 * reads back (pytest_gpu.vendors.intel.ze_init): the driver reads ZE_AFFINITY_MASK once, when the
 * first zeInit of the process creates it (intel/compute-runtime, ExecutionEnvironment's
 * parseAffinityMask), and keeps that list for the process's life, as here: a mask set after the
 * first zeInit changes nothing in this process. The mask as compute-runtime applies it (the model
 * is pytest_gpu.vendors.intel.xpu_view): unset or blank, every device; else each entry, trimmed,
 * that names a device selects it, "X.Y" selecting card X under ZE_FLAT_DEVICE_HIERARCHY=COMPOSITE
 * and nothing under FLAT (the default), and any other entry is skipped; the devices selected keep
 * the driver's order. zeInit's flags are 0, ZE_INIT_FLAG_GPU_ONLY or ZE_INIT_FLAG_VPU_ONLY (else
 * ZE_RESULT_ERROR_INVALID_ENUMERATION); without an Intel machine zeInit answers
 * ZE_RESULT_ERROR_UNINITIALIZED, and before a successful zeInit every other core call does too.
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

typedef int ze_result_t;
enum {
    ZE_RESULT_SUCCESS = 0,
    ZE_RESULT_ERROR_UNINITIALIZED = 0x78000001,
    ZE_RESULT_ERROR_UNSUPPORTED_FEATURE = 0x78000003,
    ZE_RESULT_ERROR_INVALID_ARGUMENT = 0x78000004,
    ZE_RESULT_ERROR_INVALID_NULL_HANDLE = 0x78000005,
    ZE_RESULT_ERROR_INVALID_NULL_POINTER = 0x78000007,
    ZE_RESULT_ERROR_INVALID_SIZE = 0x78000008,
    ZE_RESULT_ERROR_INVALID_ENUMERATION = 0x7800000c,
};
enum { ZES_STRUCTURE_TYPE_DEVICE_PROPERTIES = 0x1, ZES_STRUCTURE_TYPE_PROCESS_STATE = 0x16, ZES_STRUCTURE_TYPE_MEM_STATE = 0x1e };
enum { ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES = 0x3, ZE_DEVICE_TYPE_GPU = 1, ZES_MEM_HEALTH_OK = 1 };

#define ZE_MAX_DEVICE_UUID_SIZE 16
#define ZE_MAX_DEVICE_NAME 256
#define ZES_STRING_PROPERTY_SIZE 64
#define NAME_LEN 256
#define MAX_GPUS 64
#define MAX_PROCS 2048
#define LINE_LEN 512

/* ---- public structs (natural alignment, as the header declares them) ------------------ */
typedef struct {
    int stype;
    void *pNext;
    int type;
    uint32_t vendorId, deviceId, flags, subdeviceId, coreClockRate;
    uint64_t maxMemAllocSize;
    uint32_t maxHardwareContexts, maxCommandQueuePriority, numThreadsPerEU, physicalEUSimdWidth;
    uint32_t numEUsPerSubslice, numSubslicesPerSlice, numSlices;
    uint64_t timerResolution;
    uint32_t timestampValidBits, kernelTimestampValidBits;
    uint8_t uuid[ZE_MAX_DEVICE_UUID_SIZE];
    char name[ZE_MAX_DEVICE_NAME];
} ze_device_properties_t;

typedef struct {
    int stype;
    void *pNext;
    ze_device_properties_t core;
    uint32_t numSubdevices;
    char serialNumber[ZES_STRING_PROPERTY_SIZE], boardNumber[ZES_STRING_PROPERTY_SIZE];
    char brandName[ZES_STRING_PROPERTY_SIZE], modelName[ZES_STRING_PROPERTY_SIZE];
    char vendorName[ZES_STRING_PROPERTY_SIZE], driverVersion[ZES_STRING_PROPERTY_SIZE];
} zes_device_properties_t;

typedef struct {
    int stype;
    const void *pNext;
    int health;
    uint64_t free, size;
} zes_mem_state_t;

typedef struct {
    int stype;
    const void *pNext;
    uint32_t processId;
    uint64_t memSize, sharedSize;
    uint32_t engines;
} zes_process_state_t;

_Static_assert(sizeof(ze_device_properties_t) == 368, "ze_device_properties_t");
_Static_assert(sizeof(zes_device_properties_t) == 776, "zes_device_properties_t");
_Static_assert(sizeof(zes_mem_state_t) == 40, "zes_mem_state_t");
_Static_assert(sizeof(zes_process_state_t) == 48, "zes_process_state_t");

/* ---- the simulated machine ------------------------------------------------------- */
struct gpu {
    int present;
    char uuid[NAME_LEN];
    char name[NAME_LEN];
    uint8_t raw[16];
    unsigned long long total, reserved, used;
};
struct module {
    unsigned int gpu;
};
struct proc {
    char uuid[NAME_LEN];
    long pid;
    unsigned long long used;
};
struct state {
    int xpu;
    unsigned int ngpus, nprocs;
    struct gpu gpus[MAX_GPUS];
    struct proc procs[MAX_PROCS];
};

static struct state g_state, g_scratch;
static struct module g_modules[MAX_GPUS];
static int g_driver; /* the one driver handle points here */
static int g_init;         /* a zesInit succeeded (sysman-only mode) ... */
static pid_t g_init_pid;   /* ... in this process (a forked child must call zesInit itself) */
static int g_zes_decided;  /* zesInit's outcome is decided once per process (std::call_once) */
static ze_result_t g_zes_status;
static int g_from_core;    /* legacy mode: Sysman initialised by zeInit under ZES_ENABLE_SYSMAN */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

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

static int copy_field(char *dst, const char *src) {
    if (!src || !*src || strlen(src) >= NAME_LEN) return -1;
    strcpy(dst, src);
    return 0;
}

/* "51a0e000-0000-4000-8000-000000000003" -> its 16 bytes; -1 when it is not that form */
static int uuid_bytes(const char *text, uint8_t out[16]) {
    if (strlen(text) != 36) return -1;
    int n = 0;
    for (int i = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (text[i] != '-') return -1;
            continue;
        }
        char c = text[i];
        int v = (c >= '0' && c <= '9') ? c - '0' : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
        if (v < 0) return -1;
        if (n % 2 == 0) out[n / 2] = (uint8_t)(v << 4);
        else out[n / 2] |= (uint8_t)v;
        n++;
    }
    return 0;
}

static int parse_fail(const char *path, unsigned int lineno, const char *why) {
    fprintf(stderr, "fake libze_loader: %s:%u: %s\n", path, lineno, why);
    return -1;
}

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
        char *rest = line;
        char *kind = token(&rest);
        if (lineno == 1) {
            if (!kind || strcmp(kind, "v1")) rc = parse_fail(path, lineno, "expected 'v1'");
            continue;
        }
        if (!kind || kind[0] == '#') continue;
        if (!strcmp(kind, "option")) {
            char *key = token(&rest), *value = token(&rest);
            if (key && !strcmp(key, "vendor")) s->xpu = value && !strcmp(value, "xpu");
        } else if (!strcmp(kind, "gpu")) {
            if (!s->xpu) continue; /* another vendor's machine: zesInit refuses it */
            unsigned long long idx, mig;
            if (parse_ull(token(&rest), &idx) || idx != s->ngpus || idx >= MAX_GPUS) {
                rc = parse_fail(path, lineno, "gpu lines must come in index order 0..n-1 (at most 64)");
                break;
            }
            struct gpu *g = &s->gpus[idx];
            char *uuid = token(&rest);
            if (copy_field(g->uuid, uuid) || uuid_bytes(uuid, g->raw) || parse_ull(token(&rest), &g->total) ||
                parse_ull(token(&rest), &g->reserved) || parse_ull(token(&rest), &g->used) ||
                parse_ull(token(&rest), &mig) || mig != 0 || !token(&rest)) {
                rc = parse_fail(path, lineno, "bad gpu line (an Intel GPU: a 36-character UUID, no MIG)");
                break;
            }
            while (*rest == ' ') rest++;
            if (copy_field(g->name, rest)) { rc = parse_fail(path, lineno, "bad gpu name"); break; }
            g->present = 1;
            s->ngpus++;
        } else if (!strcmp(kind, "proc")) {
            unsigned long long pid;
            if (s->nprocs >= MAX_PROCS) { rc = parse_fail(path, lineno, "too many proc lines"); break; }
            struct proc *p = &s->procs[s->nprocs];
            if (copy_field(p->uuid, token(&rest)) || parse_ull(token(&rest), &pid) || pid == 0 ||
                parse_ull(token(&rest), &p->used)) {
                rc = parse_fail(path, lineno, "bad proc line");
                break;
            }
            p->pid = (long)pid;
            s->nprocs++;
        }
    }
    if (rc == 0 && ferror(f)) rc = -1;
    if (rc == 0 && lineno == 0) rc = parse_fail(path, 1, "empty file");
    fclose(f);
    return rc;
}

static int reload(void) {
    if (parse_state()) return -1;
    memcpy(&g_state, &g_scratch, sizeof g_state);
    return 0;
}

static ze_result_t leave(ze_result_t r) {
    pthread_mutex_unlock(&g_lock);
    return r;
}

static int sysman_only(void) { return g_init && g_init_pid == getpid(); }

static ze_result_t enter(void) {
    pthread_mutex_lock(&g_lock);
    if (!g_from_core && !sysman_only()) return ZE_RESULT_ERROR_UNINITIALIZED;
    reload(); /* the file vanishing or going bad keeps the last good state */
    return ZE_RESULT_SUCCESS;
}

static struct gpu *core_gpu_of(void *h);

/* A Sysman device handle: Sysman's own after zesInit; in legacy mode the core API's (dispatchSysmanApi
 * prefers legacy), whose devices are those ZE_AFFINITY_MASK left at the first zeInit. */
static struct gpu *gpu_of(void *h) {
    if (g_from_core) return core_gpu_of(h);
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_state.gpus, size = sizeof(struct gpu);
    if (p < base || p >= base + sizeof g_state.gpus || (p - base) % size) return NULL;
    struct gpu *g = h;
    return g->present ? g : NULL;
}

static struct gpu *gpu_of_module(void *h) {
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_modules, size = sizeof(struct module);
    if (p < base || p >= base + sizeof g_modules || (p - base) % size) return NULL;
    struct gpu *g = &g_state.gpus[((struct module *)h)->gpu];
    return g->present ? g : NULL;
}

static int alive(long pid) { return kill((pid_t)pid, 0) == 0 || errno == EPERM; }

/* How many fds process pid reaches its DRM client through (zes.fds; 1 when not listed). */
static unsigned long long fds_of(long pid) {
    const char *dir = getenv("PYTEST_GPU_SIM_LEDGER");
    char path[4096], line[LINE_LEN];
    unsigned long long found = 1;
    if (!dir || snprintf(path, sizeof path, "%s/zes.fds", dir) >= (int)sizeof path) return 1;
    FILE *f = fopen(path, "r");
    if (!f) return 1;
    while (fgets(line, sizeof line, f)) {
        long p;
        unsigned long long n;
        if (sscanf(line, "%ld %llu", &p, &n) == 2 && p == pid && n >= 1) found = n;
    }
    fclose(f);
    return found;
}

static int truthy_env(const char *name) {
    const char *value = getenv(name);
    return value && strtol(value, NULL, 10) != 0; /* NEO's EnvironmentVariableReader: a number */
}

/* ---- the core API's device list, fixed at the process's first zeInit ----------------- */
struct core_device {
    unsigned int gpu;
};
static pthread_once_t g_core_once = PTHREAD_ONCE_INIT;
static int g_core_ok;                         /* an Intel machine: the driver initialised */
static int g_core_init;                       /* zeInit succeeded in this process */
static unsigned int g_core_count;             /* devices the mask leaves, in the driver's order */
static struct core_device g_core[MAX_GPUS];
static int g_core_driver;                     /* the one core driver handle points here */

static char *trimmed(char *text) {
    while (*text == ' ' || *text == '\t') text++;
    size_t n = strlen(text);
    while (n && (text[n - 1] == ' ' || text[n - 1] == '\t')) text[--n] = '\0';
    return text;
}

static int digits(const char *text) { return *text && strspn(text, "0123456789") == strlen(text); }

static void core_once(void) {
    pthread_mutex_lock(&g_lock);
    int ok = reload() == 0 && g_state.xpu;
    unsigned int n = g_state.ngpus;
    pthread_mutex_unlock(&g_lock);
    if (!ok) return; /* no Intel driver */
    int chosen[MAX_GPUS] = {0};
    const char *mask = getenv("ZE_AFFINITY_MASK");
    const char *hierarchy = getenv("ZE_FLAT_DEVICE_HIERARCHY");
    int composite = hierarchy && !strcmp(hierarchy, "COMPOSITE");
    char *copy = mask ? strdup(mask) : NULL;
    if (!copy || !*trimmed(copy)) {
        for (unsigned int i = 0; i < n; i++) chosen[i] = 1;
    } else {
        for (char *entry = copy, *next; entry; entry = next) {
            next = strchr(entry, ',');
            if (next) *next++ = '\0';
            entry = trimmed(entry);
            char *dot = strchr(entry, '.');
            if (dot && composite) {
                *dot = '\0';
                if (!digits(entry) || !digits(dot + 1)) continue; /* card X restricted to tile Y */
            } else if (dot || !digits(entry)) {
                continue; /* X.Y under FLAT, or not a number: skipped */
            }
            unsigned long position = strtoul(entry, NULL, 10);
            if (position < n) chosen[position] = 1;
        }
    }
    free(copy);
    for (unsigned int i = 0; i < n; i++)
        if (chosen[i]) g_core[g_core_count++].gpu = i;
    g_core_ok = 1;
    /* the core driver creates Sysman with its devices (Device::createSysmanHandle), unless a zesInit
       already did (SysmanDeviceHandleContext::init: "already happened via zesInit") */
    pthread_mutex_lock(&g_lock);
    if (truthy_env("ZES_ENABLE_SYSMAN") && !(g_zes_decided && g_zes_status == ZE_RESULT_SUCCESS)) g_from_core = 1;
    pthread_mutex_unlock(&g_lock);
}


static struct core_device *core_of(void *h) {
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_core, size = sizeof(struct core_device);
    if (p < base || p >= base + (uintptr_t)g_core_count * size || (p - base) % size) return NULL;
    return h;
}

static struct gpu *core_gpu_of(void *h) {
    struct core_device *d = core_of(h);
    if (!d) return NULL;
    struct gpu *g = &g_state.gpus[d->gpu];
    return g->present ? g : NULL;
}

API ze_result_t zeInit(uint32_t flags) {
    if (flags > 3) return ZE_RESULT_ERROR_INVALID_ENUMERATION; /* ZE_INIT_FLAG_GPU_ONLY | VPU_ONLY */
    pthread_once(&g_core_once, core_once);
    if (!g_core_ok) return ZE_RESULT_ERROR_UNINITIALIZED;
    g_core_init = 1;
    return ZE_RESULT_SUCCESS;
}

API ze_result_t zeDriverGet(uint32_t *pCount, void **phDrivers) {
    if (!g_core_init) return ZE_RESULT_ERROR_UNINITIALIZED;
    if (!pCount) return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
    if (*pCount == 0 || *pCount > 1) *pCount = 1;
    if (phDrivers) phDrivers[0] = &g_core_driver;
    return ZE_RESULT_SUCCESS;
}

API ze_result_t zeDeviceGet(void *hDriver, uint32_t *pCount, void **phDevices) {
    if (!g_core_init) return ZE_RESULT_ERROR_UNINITIALIZED;
    if (!hDriver) return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
    if (!pCount) return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
    if (hDriver != &g_core_driver) return ZE_RESULT_ERROR_INVALID_ARGUMENT;
    if (*pCount == 0 || *pCount > g_core_count) *pCount = g_core_count;
    if (phDevices)
        for (uint32_t i = 0; i < *pCount; i++) phDevices[i] = &g_core[i];
    return ZE_RESULT_SUCCESS;
}

API ze_result_t zeDeviceGetProperties(void *hDevice, ze_device_properties_t *p) {
    if (!g_core_init) return ZE_RESULT_ERROR_UNINITIALIZED;
    if (!hDevice) return ZE_RESULT_ERROR_INVALID_NULL_HANDLE;
    if (!p) return ZE_RESULT_ERROR_INVALID_NULL_POINTER;
    struct core_device *d = core_of(hDevice);
    if (!d) return ZE_RESULT_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_lock);
    struct gpu *g = &g_state.gpus[d->gpu];
    void *next = p->pNext; /* [in]: left as the caller set it */
    int stype = p->stype;
    memset(p, 0, sizeof *p);
    p->stype = stype;
    p->pNext = next;
    p->type = ZE_DEVICE_TYPE_GPU;
    p->vendorId = 0x8086;
    p->deviceId = 0x0bd5; /* Data Center GPU Max 1550 */
    p->maxMemAllocSize = g->total - g->reserved;
    memcpy(p->uuid, g->raw, 16);
    snprintf(p->name, sizeof p->name, "%s", g->name);
    return leave(ZE_RESULT_SUCCESS);
}

/* ---- the API ---------------------------------------------------------------------- */

API ze_result_t zesInit(uint32_t flags) {
    if (flags > 1) return ZE_RESULT_ERROR_INVALID_ENUMERATION;
    pthread_mutex_lock(&g_lock);
    if (g_zes_decided && g_init_pid == getpid()) return leave(g_zes_status); /* std::call_once */
    if (reload() || !g_state.xpu) return leave(ZE_RESULT_ERROR_UNINITIALIZED); /* no Intel driver */
    const char *product = getenv("PYTEST_GPU_SIM_ZES");
    g_zes_decided = 1;
    g_init_pid = getpid();
    if (g_from_core && product && !strcmp(product, "no-zesinit")) {
        g_zes_status = ZE_RESULT_ERROR_UNSUPPORTED_FEATURE; /* "Sysman Initialization already happened via zeInit" */
        return leave(g_zes_status);
    }
    g_from_core = 0; /* LinuxSysmanImp::init: a product with zesInit support leaves legacy mode */
    g_init = 1;
    g_zes_status = ZE_RESULT_SUCCESS;
    return leave(g_zes_status);
}

API ze_result_t zesDriverGet(uint32_t *pCount, void **phDrivers) {
    ze_result_t r = enter();
    if (r) return leave(r);
    if (!sysman_only()) return leave(ZE_RESULT_ERROR_UNINITIALIZED); /* legacy mode: zeDriverGet's handles */
    if (!pCount) return leave(ZE_RESULT_ERROR_INVALID_NULL_POINTER);
    if (*pCount == 0 || *pCount > 1) *pCount = 1;
    if (phDrivers) phDrivers[0] = &g_driver;
    return leave(ZE_RESULT_SUCCESS);
}

API ze_result_t zesDeviceGet(void *hDriver, uint32_t *pCount, void **phDevices) {
    ze_result_t r = enter();
    if (r) return leave(r);
    if (!sysman_only()) return leave(ZE_RESULT_ERROR_UNINITIALIZED); /* legacy mode: zeDeviceGet's handles */
    if (!hDriver) return leave(ZE_RESULT_ERROR_INVALID_NULL_HANDLE);
    if (!pCount) return leave(ZE_RESULT_ERROR_INVALID_NULL_POINTER);
    if (hDriver != &g_driver) return leave(ZE_RESULT_ERROR_INVALID_ARGUMENT);
    uint32_t n = g_state.ngpus;
    if (*pCount == 0 || *pCount > n) *pCount = n;
    if (phDevices)
        for (uint32_t i = 0; i < *pCount; i++) phDevices[i] = &g_state.gpus[i];
    return leave(ZE_RESULT_SUCCESS);
}

API ze_result_t zesDeviceGetProperties(void *hDevice, zes_device_properties_t *p) {
    ze_result_t r = enter();
    if (r) return leave(r);
    if (!hDevice) return leave(ZE_RESULT_ERROR_INVALID_NULL_HANDLE);
    if (!p) return leave(ZE_RESULT_ERROR_INVALID_NULL_POINTER);
    struct gpu *g = gpu_of(hDevice);
    if (!g) return leave(ZE_RESULT_ERROR_INVALID_ARGUMENT);
    void *next = p->pNext; /* [in]: left as the caller set it */
    int stype = p->stype;
    memset(p, 0, sizeof *p);
    p->stype = stype;
    p->pNext = next;
    p->core.stype = ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES;
    p->core.type = ZE_DEVICE_TYPE_GPU;
    p->core.vendorId = 0x8086;
    p->core.deviceId = 0x0bd5; /* Data Center GPU Max 1550 */
    p->core.maxMemAllocSize = g->total - g->reserved;
    memcpy(p->core.uuid, g->raw, 16);
    snprintf(p->core.name, sizeof p->core.name, "%s", g->name);
    p->numSubdevices = 0;
    snprintf(p->serialNumber, sizeof p->serialNumber, "unknown");
    snprintf(p->boardNumber, sizeof p->boardNumber, "unknown");
    snprintf(p->brandName, sizeof p->brandName, "Intel(R) Corporation");
    snprintf(p->modelName, sizeof p->modelName, "%.63s", g->name);
    snprintf(p->vendorName, sizeof p->vendorName, "Intel(R) Corporation");
    snprintf(p->driverVersion, sizeof p->driverVersion, "fake");
    return leave(ZE_RESULT_SUCCESS);
}

API ze_result_t zesDeviceEnumMemoryModules(void *hDevice, uint32_t *pCount, void **phMemory) {
    ze_result_t r = enter();
    if (r) return leave(r);
    if (!hDevice) return leave(ZE_RESULT_ERROR_INVALID_NULL_HANDLE);
    if (!pCount) return leave(ZE_RESULT_ERROR_INVALID_NULL_POINTER);
    struct gpu *g = gpu_of(hDevice);
    if (!g) return leave(ZE_RESULT_ERROR_INVALID_ARGUMENT);
    if (*pCount == 0 || *pCount > 1) *pCount = 1;
    g_modules[g - g_state.gpus].gpu = (unsigned int)(g - g_state.gpus);
    if (phMemory) phMemory[0] = &g_modules[g - g_state.gpus];
    return leave(ZE_RESULT_SUCCESS);
}

API ze_result_t zesMemoryGetState(void *hMemory, zes_mem_state_t *s) {
    ze_result_t r = enter();
    if (r) return leave(r);
    if (!hMemory) return leave(ZE_RESULT_ERROR_INVALID_NULL_HANDLE);
    if (!s) return leave(ZE_RESULT_ERROR_INVALID_NULL_POINTER);
    struct gpu *g = gpu_of_module(hMemory);
    if (!g) return leave(ZE_RESULT_ERROR_INVALID_ARGUMENT);
    unsigned long long used = 0; /* the ledger's gpu line may still count processes that are gone */
    for (unsigned int i = 0; i < g_state.nprocs; i++)
        if (!strcmp(g_state.procs[i].uuid, g->uuid) && alive(g_state.procs[i].pid)) used += g_state.procs[i].used;
    if (used > g->used) used = g->used;
    unsigned long long size = g->total - g->reserved;
    s->health = ZES_MEM_HEALTH_OK;
    s->size = size;
    s->free = used > size ? 0 : size - used;
    return leave(ZE_RESULT_SUCCESS);
}

API ze_result_t zesDeviceProcessesGetState(void *hDevice, uint32_t *pCount, zes_process_state_t *out) {
    ze_result_t r = enter();
    if (r) return leave(r);
    if (!hDevice) return leave(ZE_RESULT_ERROR_INVALID_NULL_HANDLE);
    if (!pCount) return leave(ZE_RESULT_ERROR_INVALID_NULL_POINTER);
    struct gpu *g = gpu_of(hDevice);
    if (!g) return leave(ZE_RESULT_ERROR_INVALID_ARGUMENT);
    uint32_t n = 0, room = *pCount;
    for (unsigned int i = 0; i < g_state.nprocs; i++) {
        struct proc *p = &g_state.procs[i];
        if (strcmp(p->uuid, g->uuid) || !alive(p->pid)) continue;
        if (out && n < room) {
            out[n].processId = (uint32_t)p->pid;
            out[n].memSize = p->used * fds_of(p->pid); /* every fd's drm-total-vram, summed */
            out[n].sharedSize = 0;
            out[n].engines = 0;
        }
        n++;
    }
    if (room == 0 || !out) { *pCount = n; return leave(ZE_RESULT_SUCCESS); }
    if (room < n) return leave(ZE_RESULT_ERROR_INVALID_SIZE); /* filled what fits, *pCount kept */
    *pCount = n;
    return leave(ZE_RESULT_SUCCESS);
}
