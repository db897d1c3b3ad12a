/*
 * A fake libamd_smi.so for pytest-gpu's simulated AMD GPUs, loaded by the real `amdsmi`
 * Python package (a ctypes wrapper).
 *
 * It implements the part of the AMD SMI C API that the plugin uses, with the signatures,
 * struct layouts and return codes of amdsmi 7.0.2 (PyPI; its amdsmi_wrapper.py gives the
 * layouts) and the behaviour of ROCm/amdsmi's src/amd_smi/amd_smi.cc (commit 0ceca28):
 * AMDSMI_STATUS_NOT_INIT before amdsmi_init, the two-call size protocol of the socket and
 * processor handle lists, AMDSMI_STATUS_OUT_OF_RESOURCES for a process list longer than the
 * caller's buffer, AMDSMI_STATUS_INVAL for a handle that names no device, and
 * AMDSMI_STATUS_DRIVER_NOT_LOADED from amdsmi_init where there is no amdgpu driver (here:
 * no state file, or a state file of another vendor's machine).
 *
 * The package binds every function it knows when it is imported, so every other symbol its
 * wrapper names is generated next to this file (see pytest_gpu/sim/amdsmi/__init__.py) and
 * answers AMDSMI_STATUS_NOT_SUPPORTED, as the real library does for what a GPU lacks.
 *
 * Data: the text file $PYTEST_GPU_SIM_LEDGER/nvml.state that the simulated-GPU ledger
 * rewrites atomically on every change (format: pytest_gpu/sim/nvml/__init__.py), with
 * "option vendor amd"; re-read on every call.  UUIDs in it are ROCr's ("GPU-" and the 16
 * hex digits of the unique id, the ASIC serial); amdsmi_get_gpu_device_uuid derives its own
 * 36-character form from that serial as amd_smi_uuid.cc does.
 *
 * Units, as amdsmi.h states them: VRAM totals and usage in bytes
 * (amdsmi_get_gpu_memory_total/usage), amdsmi_vram_usage_t in MB, a process's `mem` and
 * `memory_usage` in bytes.  Option "amd_proc_unit N" rounds every per-process figure down to a
 * multiple of N bytes and "amd_proc_refresh_ms N" serves the process list from a snapshot at
 * most N ms old (both 0 by default): the coarser and staler drivers the plugin must tolerate.
 * The snapshot is this process's, taken when a list is asked for and it is N ms old or more
 * (so at most N ms old, the bound the issue states), and kept across amdsmi_init.
 * "amd_rocr_order 3,0,1,2" makes ROCr's enumeration (hsa_id, hip_id) differ from amdsmi's
 * indices, as it does on some machines (pytorch #131901, ROCm/amdsmi #175).
 *
 * Versions: $PYTEST_GPU_SIM_ROCM ("6.1.0", ...; unset: the newest) picks the amdsmi modelled.
 * - Before rocm-6.1.1 (ROCm/amdsmi at rocm-6.1.0, include/amd_smi/amdsmi.h): the process list
 *   is of amdsmi_process_handle_t (uint32 pids), and amdsmi_get_gpu_process_info(handle, pid,
 *   info) fills the 672-byte amdsmi_proc_info_t of that release (reserved[4] after
 *   container_name, no cu_occupancy). The Python side of those releases (process handles, then
 *   ctypes structs at 6.1.1, dicts from 6.1.2) is pytest_gpu/sim/amdsmi/__init__.py (install_legacy).
 * - "option amd_proc_fds N": each process holds its one DRM client under N fds (dup, fork,
 *   fd passing). amdsmi up to 7.0 (src/amd_smi/fdinfo.cc at 0ceca28: gpuvsmi_get_pid_info)
 *   adds drm-memory-vram over every fdinfo of the process on that GPU, so it reports N times
 *   the memory; from 7.1 on, counting each drm-client-id once (as the issue reports of
 *   rocm-systems; that source is not in the snapshots read), it reports it once.
 * - "option amd_no_uuid 1,3": GPUs whose unique id is 0 (no sysfs unique_id): asic_serial is
 *   empty (amd_smi.cc's amdsmi_get_gpu_asic_info reads device/unique_id, at 0ceca28) and the
 *   enumeration info's hip_uuid is HSA's "GPU-XX" (ROCR-Runtime amd_gpu_agent.cpp,
 *   HSA_AMD_AGENT_INFO_UUID, at c7785a6d), the same for every such GPU.
 * - "option amd_apu 1": an APU (MI300A): a process's memory is GTT, memory_usage.vram_mem 0.
 * fake_amdsmi_inits() counts amdsmi_init calls that initialised (tests of the plugin's cost).
 *
 * Handles point into static tables (one socket per GPU, as on MI300X), so a handle keeps
 * naming the same device for as long as that device is in the state file.
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
#include <time.h>

#define API __attribute__((visibility("default")))

typedef int amdsmi_status_t;
enum {
    AMDSMI_STATUS_SUCCESS = 0,
    AMDSMI_STATUS_INVAL = 1,
    AMDSMI_STATUS_NOT_SUPPORTED = 2,
    AMDSMI_STATUS_NO_PERM = 10,
    AMDSMI_STATUS_FILE_ERROR = 14,
    AMDSMI_STATUS_OUT_OF_RESOURCES = 15,
    AMDSMI_STATUS_NOT_FOUND = 31,
    AMDSMI_STATUS_NOT_INIT = 32,
    AMDSMI_STATUS_DRIVER_NOT_LOADED = 34,
    AMDSMI_STATUS_UNKNOWN_ERROR = -1,
};
enum { AMDSMI_PROCESSOR_TYPE_AMD_GPU = 1 };
enum { AMDSMI_MEM_TYPE_VRAM = 0, AMDSMI_MEM_TYPE_VIS_VRAM = 1, AMDSMI_MEM_TYPE_GTT = 2 };
#define AMDSMI_INIT_AMD_GPUS 2ull
#define AMDSMI_GPU_UUID_SIZE 38
#define NAME_LEN 256

#define MAX_GPUS 64
#define MAX_PROCS 2048
#define LINE_LEN 512
#define DEVICE_ID 0x74a1 /* MI300X's PCI device id */

/* ---- public structs (amdsmi 7.0.2's layouts, _pack_ = 1 with explicit padding) -------- */
#pragma pack(push, 1)
typedef union {
    struct {
        uint64_t function_number : 3;
        uint64_t device_number : 5;
        uint64_t bus_number : 8;
        uint64_t domain_number : 48;
    } bdf;
    uint64_t as_uint;
} amdsmi_bdf_t;

typedef struct {
    char market_name[NAME_LEN];
    uint32_t vendor_id;
    char vendor_name[NAME_LEN];
    uint32_t subvendor_id;
    uint64_t device_id;
    uint32_t rev_id;
    char asic_serial[NAME_LEN];
    uint32_t oam_id;
    uint32_t num_of_compute_units;
    uint8_t padding0[4];
    uint64_t target_graphics_version;
    uint32_t subsystem_id;
    uint32_t reserved[21];
} amdsmi_asic_info_t;

typedef struct {
    uint32_t drm_render;
    uint32_t drm_card;
    uint32_t hsa_id;
    uint32_t hip_id;
    char hip_uuid[NAME_LEN];
} amdsmi_enumeration_info_t;

typedef struct {
    uint32_t vram_total; /* MB */
    uint32_t vram_used;  /* MB */
    uint32_t reserved[2];
} amdsmi_vram_usage_t;

typedef struct {
    char name[NAME_LEN];
    uint32_t pid;
    uint8_t padding0[4];
    uint64_t mem; /* bytes */
    struct {
        uint64_t gfx, enc;
        uint32_t reserved[12];
    } engine_usage;
    struct {
        uint64_t gtt_mem, cpu_mem, vram_mem; /* bytes */
        uint32_t reserved[10];
    } memory_usage;
    char container_name[NAME_LEN];
    uint32_t cu_occupancy;
    uint32_t reserved[11];
} amdsmi_proc_info_t;

typedef struct {
    uint32_t major, minor, release;
    uint8_t padding0[4];
    const char *build;
} amdsmi_version_t;
#pragma pack(pop)

_Static_assert(sizeof(amdsmi_bdf_t) == 8, "amdsmi_bdf_t");
_Static_assert(sizeof(amdsmi_asic_info_t) == 896, "amdsmi_asic_info_t");
_Static_assert(sizeof(amdsmi_enumeration_info_t) == 272, "amdsmi_enumeration_info_t");
_Static_assert(sizeof(amdsmi_proc_info_t) == 704, "amdsmi_proc_info_t");
_Static_assert(sizeof(amdsmi_vram_usage_t) == 16, "amdsmi_vram_usage_t");
_Static_assert(sizeof(amdsmi_version_t) == 24, "amdsmi_version_t");

/* ---- the simulated machine ------------------------------------------------------- */

struct gpu {
    int present;
    unsigned int index;
    char uuid[NAME_LEN]; /* ROCr's: GPU-<16 hex digits of the serial> */
    char name[NAME_LEN];
    unsigned long long serial, total, reserved, used;
    amdsmi_status_t fault;
    int no_uuid; /* no unique id: "GPU-XX" to HSA, no asic_serial */
};
struct socket_st {
    unsigned int index;
};
struct proc {
    char uuid[NAME_LEN];
    long pid;
    unsigned long long used;
};
struct state {
    int amd, apu;
    unsigned long long proc_fds;
    unsigned int ngpus;
    unsigned long long proc_unit, refresh_ms;
    int rocr_position[MAX_GPUS]; /* GPU index -> its place in ROCr's enumeration, -1: amdsmi's order */
    int no_uuid_of[MAX_GPUS];    /* GPU index -> no unique id ("option amd_no_uuid") */
    struct gpu gpus[MAX_GPUS];
    unsigned int nprocs;
    struct proc procs[MAX_PROCS];
};

static struct state g_state, g_scratch;
static struct socket_st g_sockets[MAX_GPUS];
/* the process list as last refreshed (amd_proc_refresh_ms) */
static struct proc g_snapshot[MAX_PROCS];
static unsigned int g_nsnapshot;
static long long g_snapshot_ms = -1;
static int g_init;
static long g_inits; /* amdsmi_init calls that initialised */

/* The modelled release ($PYTEST_GPU_SIM_ROCM) as major*10000 + minor*100 + patch; unset: the newest. */
static long modelled(void) {
    const char *v = getenv("PYTEST_GPU_SIM_ROCM");
    int major = 0, minor = 0, patch = 0;
    if (!v || !*v || sscanf(v, "%d.%d.%d", &major, &minor, &patch) < 1) return 999999;
    return major * 10000L + minor * 100 + patch;
}
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;

static int parse_fail(const char *path, unsigned int lineno, const char *why) {
    fprintf(stderr, "fake libamd_smi: %s:%u: %s\n", path, lineno, why);
    return -1;
}

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

static amdsmi_status_t fault_code(const char *t) {
    if (!strcmp(t, "none")) return AMDSMI_STATUS_SUCCESS;
    if (!strcmp(t, "no_permission")) return AMDSMI_STATUS_NO_PERM;
    if (!strcmp(t, "gpu_is_lost")) return AMDSMI_STATUS_FILE_ERROR; /* its sysfs files are gone */
    return AMDSMI_STATUS_UNKNOWN_ERROR;
}

/* Read the state file into g_scratch: 0, or -1 when it is missing or malformed. */
static int parse_state(void) {
    const char *dir = getenv("PYTEST_GPU_SIM_LEDGER");
    char path[4096], line[LINE_LEN];
    if (!dir || !*dir) return -1;
    if (snprintf(path, sizeof path, "%s/nvml.state", dir) >= (int)sizeof path) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    struct state *s = &g_scratch;
    memset(s, 0, sizeof *s);
    for (unsigned int i = 0; i < MAX_GPUS; i++) s->rocr_position[i] = -1;
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
            if (key && !strcmp(key, "vendor")) s->amd = value && !strcmp(value, "amd");
            else if (key && !strcmp(key, "amd_proc_unit") && parse_ull(value, &s->proc_unit))
                rc = parse_fail(path, lineno, "bad amd_proc_unit");
            else if (key && !strcmp(key, "amd_proc_refresh_ms") && parse_ull(value, &s->refresh_ms))
                rc = parse_fail(path, lineno, "bad amd_proc_refresh_ms");
            else if (key && !strcmp(key, "amd_proc_fds") && (parse_ull(value, &s->proc_fds) || !s->proc_fds))
                rc = parse_fail(path, lineno, "bad amd_proc_fds");
            else if (key && !strcmp(key, "amd_apu")) s->apu = value && !strcmp(value, "1");
            else if (key && !strcmp(key, "amd_no_uuid")) {
                /* "1,3": gpu lines come later, so the marks wait in no_uuid_of until then */
                for (char *item = value ? strtok(value, ",") : NULL; item; item = strtok(NULL, ",")) {
                    unsigned long long gpu;
                    if (parse_ull(item, &gpu) || gpu >= MAX_GPUS) { rc = parse_fail(path, lineno, "bad amd_no_uuid"); break; }
                    s->no_uuid_of[gpu] = 1;
                }
            }
            else if (key && !strcmp(key, "amd_rocr_order")) {
                /* "3,0,1,2": GPU 3 is ROCr's first; the ledger checked it is a permutation */
                int place = 0;
                for (char *item = value ? strtok(value, ",") : NULL; item; item = strtok(NULL, ",")) {
                    unsigned long long gpu;
                    if (parse_ull(item, &gpu) || gpu >= MAX_GPUS) { rc = parse_fail(path, lineno, "bad amd_rocr_order"); break; }
                    s->rocr_position[gpu] = place++;
                }
            }
        } else if (!strcmp(kind, "gpu")) {
            unsigned long long idx, mig;
            if (parse_ull(token(&rest), &idx) || idx != s->ngpus || idx >= MAX_GPUS) {
                rc = parse_fail(path, lineno, "gpu lines must come in index order 0..n-1 (at most 64)");
                break;
            }
            struct gpu *g = &s->gpus[idx];
            char *uuid = token(&rest);
            if (copy_field(g->uuid, uuid) || strncmp(uuid, "GPU-", 4) || strlen(uuid) != 20 ||
                parse_ull(token(&rest), &g->total) || parse_ull(token(&rest), &g->reserved) ||
                parse_ull(token(&rest), &g->used) || parse_ull(token(&rest), &mig) || mig != 0) {
                rc = parse_fail(path, lineno, "bad gpu line (an AMD GPU: a GPU-<16 hex> UUID, no MIG)");
                break;
            }
            char *end;
            g->serial = strtoull(uuid + 4, &end, 16);
            char *fault = token(&rest);
            while (*rest == ' ') rest++;
            if (*end || !fault || copy_field(g->name, rest)) {
                rc = parse_fail(path, lineno, "bad gpu line (serial, fault or name)");
                break;
            }
            g->present = 1;
            g->index = (unsigned int)idx;
            g->no_uuid = s->no_uuid_of[idx];
            g->fault = fault_code(fault);
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
        /* mig lines never name an AMD GPU (the gpu line refuses MIG mode); others: newer writers */
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

static struct gpu *gpu_of(void *h) {
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_state.gpus, size = sizeof(struct gpu);
    if (p < base || p >= base + sizeof g_state.gpus || (p - base) % size) return NULL;
    struct gpu *g = h;
    return g->present ? g : NULL;
}

static amdsmi_status_t leave(amdsmi_status_t r) {
    pthread_mutex_unlock(&g_lock);
    return r;
}

static amdsmi_status_t enter(void) {
    pthread_mutex_lock(&g_lock);
    if (!g_init) return AMDSMI_STATUS_NOT_INIT;
    reload(); /* the file vanishing or going bad keeps the last good state */
    return AMDSMI_STATUS_SUCCESS;
}

/* enter() plus a handle that names a present GPU (whose fault, if any, is returned). */
static amdsmi_status_t enter_gpu(void *h, struct gpu **out) {
    amdsmi_status_t r = enter();
    if (r) return r;
    struct gpu *g = gpu_of(h);
    if (!g) return AMDSMI_STATUS_INVAL;
    if (g->fault) return g->fault;
    *out = g;
    return AMDSMI_STATUS_SUCCESS;
}

/* Gone processes (zombies included: the driver frees at exit, before the reaping) are not listed. */
static int alive(long pid) {
    if (kill((pid_t)pid, 0) != 0 && errno != EPERM) return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *end = strrchr(buf, ')');
    return !(end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X'));
}

static unsigned long long live_used(const struct gpu *g) {
    unsigned long long gone = 0;
    for (unsigned int i = 0; i < g_state.nprocs; i++)
        if (!strcmp(g_state.procs[i].uuid, g->uuid) && !alive(g_state.procs[i].pid)) gone += g_state.procs[i].used;
    return g->used > gone ? g->used - gone : 0;
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- the API ------------------------------------------------------------------------- */

API amdsmi_status_t amdsmi_init(uint64_t flags) {
    pthread_mutex_lock(&g_lock);
    if (g_init) return leave(AMDSMI_STATUS_SUCCESS);
    if (!(flags & AMDSMI_INIT_AMD_GPUS)) { /* CPUs only: this fake has no AMD CPU driver */
        g_init = 1;
        g_state.ngpus = 0;
        return leave(AMDSMI_STATUS_SUCCESS);
    }
    if (reload() || !g_state.amd) return leave(AMDSMI_STATUS_DRIVER_NOT_LOADED);
    for (unsigned int i = 0; i < MAX_GPUS; i++) g_sockets[i].index = i;
    g_init = 1;
    g_inits++;
    /* g_snapshot_ms is not reset: the list's staleness is the driver's, not this library's, and
       outlives an amdsmi_shut_down/amdsmi_init pair (as a verifier that opens amdsmi per sample does) */
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_shut_down(void) {
    pthread_mutex_lock(&g_lock);
    g_init = 0;
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_get_socket_handles(uint32_t *count, void **handles) {
    amdsmi_status_t r = enter();
    if (r) return leave(r);
    if (!count) return leave(AMDSMI_STATUS_INVAL);
    if (!handles) {
        *count = g_state.ngpus;
        return leave(AMDSMI_STATUS_SUCCESS);
    }
    if (*count > g_state.ngpus) *count = g_state.ngpus;
    for (uint32_t i = 0; i < *count; i++) handles[i] = &g_sockets[i];
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_get_processor_handles(void *socket, uint32_t *count, void **handles) {
    amdsmi_status_t r = enter();
    if (r) return leave(r);
    uintptr_t p = (uintptr_t)socket, base = (uintptr_t)g_sockets;
    if (!count || p < base || p >= base + sizeof g_sockets || (p - base) % sizeof(struct socket_st))
        return leave(AMDSMI_STATUS_INVAL);
    unsigned int index = ((struct socket_st *)socket)->index;
    if (index >= g_state.ngpus) return leave(AMDSMI_STATUS_INVAL);
    if (!handles) {
        *count = 1;
        return leave(AMDSMI_STATUS_SUCCESS);
    }
    if (*count > 1) *count = 1;
    if (*count) handles[0] = &g_state.gpus[index];
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_get_processor_type(void *h, uint32_t *type) {
    amdsmi_status_t r = enter();
    if (r) return leave(r);
    if (!gpu_of(h) || !type) return leave(AMDSMI_STATUS_INVAL);
    *type = AMDSMI_PROCESSOR_TYPE_AMD_GPU;
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_get_gpu_device_bdf(void *h, amdsmi_bdf_t *bdf) {
    struct gpu *g;
    amdsmi_status_t r = enter_gpu(h, &g);
    if (r) return leave(r);
    if (!bdf) return leave(AMDSMI_STATUS_INVAL);
    bdf->as_uint = 0;
    /* eight GPUs a domain, on buses 0x05, 0x25, ... as on an MI300X platform */
    bdf->bdf.domain_number = g->index / 8;
    bdf->bdf.bus_number = 0x05 + (g->index % 8) * 0x20;
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_get_gpu_device_uuid(void *h, uint32_t *length, char *uuid) {
    struct gpu *g;
    amdsmi_status_t r = enter_gpu(h, &g);
    if (r) return leave(r);
    if (!length || !uuid || *length < AMDSMI_GPU_UUID_SIZE) return leave(AMDSMI_STATUS_INVAL);
    /* amd_smi_uuid.cc's amdsmi_uuid_gen(serial, device id, fcn 0xff): version 1, variant 2 */
    uint64_t s = g->no_uuid ? 0 : g->serial; /* derived from the serial: the same for every GPU without one */
    uint32_t time_low = DEVICE_ID | (0xffu << 16) | ((uint32_t)(s >> 56) << 24);
    snprintf(uuid, AMDSMI_GPU_UUID_SIZE, "%08x-%04x-%04x-%02x%02x-%04x%08x", time_low, 0, 1u << 12, 0x80,
             (unsigned)((s >> 48) & 0xff), (unsigned)((s >> 32) & 0xffff), (unsigned)(s & 0xffffffffu));
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_get_gpu_enumeration_info(void *h, amdsmi_enumeration_info_t *info) {
    struct gpu *g;
    amdsmi_status_t r = enter_gpu(h, &g);
    if (r) return leave(r);
    if (!info) return leave(AMDSMI_STATUS_INVAL);
    memset(info, 0, sizeof *info);
    info->drm_card = g->index;
    info->drm_render = 128 + g->index;
    unsigned int place = g_state.rocr_position[g->index] >= 0 ? (unsigned int)g_state.rocr_position[g->index] : g->index;
    info->hsa_id = 1 + place; /* HSA node 0 is the CPU; the GPUs' nodes in ROCr's order */
    info->hip_id = place;
    snprintf(info->hip_uuid, sizeof info->hip_uuid, "%s", g->no_uuid ? "GPU-XX" : g->uuid);
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_get_gpu_asic_info(void *h, amdsmi_asic_info_t *info) {
    struct gpu *g;
    amdsmi_status_t r = enter_gpu(h, &g);
    if (r) return leave(r);
    if (!info) return leave(AMDSMI_STATUS_INVAL);
    memset(info, 0, sizeof *info);
    snprintf(info->market_name, NAME_LEN, "%s", g->name);
    info->vendor_id = 0x1002;
    snprintf(info->vendor_name, NAME_LEN, "Advanced Micro Devices Inc. [AMD/ATI]");
    info->subvendor_id = 0x1002;
    info->device_id = DEVICE_ID;
    if (!g->no_uuid) snprintf(info->asic_serial, NAME_LEN, "%016llX", g->serial); /* else: no unique_id file */
    info->oam_id = g->index;
    info->num_of_compute_units = 304;
    info->target_graphics_version = 0x942;
    info->subsystem_id = 0x74a1;
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_get_gpu_memory_total(void *h, uint32_t type, uint64_t *total) {
    struct gpu *g;
    amdsmi_status_t r = enter_gpu(h, &g);
    if (r) return leave(r);
    if (!total || type > AMDSMI_MEM_TYPE_GTT) return leave(AMDSMI_STATUS_INVAL);
    if (type != AMDSMI_MEM_TYPE_VRAM) return leave(AMDSMI_STATUS_NOT_SUPPORTED);
    *total = g->total;
    return leave(AMDSMI_STATUS_SUCCESS);
}

/* VRAM in use: the driver's own reservation counts as used here (amdsmi has no "reserved"). */
API amdsmi_status_t amdsmi_get_gpu_memory_usage(void *h, uint32_t type, uint64_t *used) {
    struct gpu *g;
    amdsmi_status_t r = enter_gpu(h, &g);
    if (r) return leave(r);
    if (!used || type > AMDSMI_MEM_TYPE_GTT) return leave(AMDSMI_STATUS_INVAL);
    if (type != AMDSMI_MEM_TYPE_VRAM) return leave(AMDSMI_STATUS_NOT_SUPPORTED);
    *used = g->reserved + live_used(g);
    return leave(AMDSMI_STATUS_SUCCESS);
}

API amdsmi_status_t amdsmi_get_gpu_vram_usage(void *h, amdsmi_vram_usage_t *info) {
    struct gpu *g;
    amdsmi_status_t r = enter_gpu(h, &g);
    if (r) return leave(r);
    if (!info) return leave(AMDSMI_STATUS_INVAL);
    memset(info, 0, sizeof *info);
    info->vram_total = (uint32_t)(g->total / (1024 * 1024));
    info->vram_used = (uint32_t)((g->reserved + live_used(g)) / (1024 * 1024));
    return leave(AMDSMI_STATUS_SUCCESS);
}

API long fake_amdsmi_inits(void) { return g_inits; }

/* One process's record as this release's amdsmi_get_gpu_process_info fills it. */
static void fill_info(const struct proc *p, amdsmi_proc_info_t *out) {
    memset(out, 0, sizeof *out);
    out->pid = (uint32_t)p->pid;
    char path[64];
    snprintf(path, sizeof path, "/proc/%ld/comm", p->pid);
    FILE *f = fopen(path, "r");
    if (f) {
        if (fgets(out->name, sizeof out->name, f)) out->name[strcspn(out->name, "\n")] = 0;
        fclose(f);
    }
    unsigned long long used = p->used;
    if (g_state.proc_fds > 1 && modelled() < 70100) used *= g_state.proc_fds; /* summed per fd */
    if (g_state.proc_unit) used -= used % g_state.proc_unit;
    out->mem = used;
    if (g_state.apu) out->memory_usage.gtt_mem = used; /* an APU's memory is GTT: vram_mem stays 0 */
    else out->memory_usage.vram_mem = used;
    out->cu_occupancy = 0xFFFFFFFFu; /* not available */
}

/* rocm-6.1.0's amdsmi_get_gpu_process_info: the pid's record, in that release's 672-byte layout. */
API amdsmi_status_t amdsmi_get_gpu_process_info(void *h, uint32_t pid, void *info) {
    struct gpu *g;
    amdsmi_status_t r = enter_gpu(h, &g);
    if (r) return leave(r);
    if (!info) return leave(AMDSMI_STATUS_INVAL);
    if (modelled() >= 60101) return leave(AMDSMI_STATUS_NOT_SUPPORTED); /* gone from the API */
    for (unsigned int i = 0; i < g_nsnapshot; i++) {
        if (strcmp(g_snapshot[i].uuid, g->uuid) || g_snapshot[i].pid != (long)pid) continue;
        amdsmi_proc_info_t full;
        fill_info(&g_snapshot[i], &full);
        full.cu_occupancy = 0;
        memcpy(info, &full, 672);
        return leave(AMDSMI_STATUS_SUCCESS);
    }
    return leave(AMDSMI_STATUS_NOT_FOUND); /* gpuvsmi_get_pid_info: no fdinfo on that GPU (gone) */
}

API amdsmi_status_t amdsmi_get_gpu_process_list(void *h, uint32_t *max_processes, amdsmi_proc_info_t *list) {
    struct gpu *g;
    amdsmi_status_t r = enter_gpu(h, &g);
    if (r) return leave(r);
    if (!max_processes) return leave(AMDSMI_STATUS_INVAL);
    long long now = now_ms();
    if (g_snapshot_ms < 0 || (unsigned long long)(now - g_snapshot_ms) >= g_state.refresh_ms) {
        g_nsnapshot = 0;
        for (unsigned int i = 0; i < g_state.nprocs; i++)
            if (alive(g_state.procs[i].pid)) g_snapshot[g_nsnapshot++] = g_state.procs[i];
        g_snapshot_ms = now;
    }
    uint32_t found = 0;
    for (unsigned int i = 0; i < g_nsnapshot; i++) found += !strcmp(g_snapshot[i].uuid, g->uuid);
    if (*max_processes == 0 || found == 0) {
        *max_processes = found;
        return leave(AMDSMI_STATUS_SUCCESS);
    }
    if (!list) return leave(AMDSMI_STATUS_INVAL);
    uint32_t room = *max_processes, k = 0;
    int handles = modelled() < 60101; /* rocm-6.1.0 and before: amdsmi_process_handle_t, the pid */
    for (unsigned int i = 0; i < g_nsnapshot && k < room; i++) {
        const struct proc *p = &g_snapshot[i];
        if (strcmp(p->uuid, g->uuid)) continue;
        if (handles) ((uint32_t *)(void *)list)[k++] = (uint32_t)p->pid;
        else fill_info(p, &list[k++]);
    }
    *max_processes = found;
    return leave(room >= found ? AMDSMI_STATUS_SUCCESS : AMDSMI_STATUS_OUT_OF_RESOURCES);
}

API amdsmi_status_t amdsmi_get_lib_version(amdsmi_version_t *version) {
    if (!version) return AMDSMI_STATUS_INVAL;
    static const char build[] = "7.0.2-fake";
    memset(version, 0, sizeof *version);
    version->major = 7;
    version->minor = 0;
    version->release = 2;
    version->build = build;
    return AMDSMI_STATUS_SUCCESS;
}

API amdsmi_status_t amdsmi_status_code_to_string(amdsmi_status_t status, const char **text) {
    if (!text) return AMDSMI_STATUS_INVAL;
    switch (status) {
    case AMDSMI_STATUS_SUCCESS: *text = "AMDSMI_STATUS_SUCCESS: Call succeeded"; break;
    case AMDSMI_STATUS_INVAL: *text = "AMDSMI_STATUS_INVAL: Invalid parameters"; break;
    case AMDSMI_STATUS_NOT_SUPPORTED: *text = "AMDSMI_STATUS_NOT_SUPPORTED: Command not supported"; break;
    case AMDSMI_STATUS_NO_PERM: *text = "AMDSMI_STATUS_NO_PERM: Permission Denied"; break;
    case AMDSMI_STATUS_NOT_INIT: *text = "AMDSMI_STATUS_NOT_INIT: Device not initialized"; break;
    case AMDSMI_STATUS_DRIVER_NOT_LOADED: *text = "AMDSMI_STATUS_DRIVER_NOT_LOADED: Driver not loaded"; break;
    default: *text = "AMDSMI_STATUS_UNKNOWN_ERROR: An unknown error occurred"; break;
    }
    return AMDSMI_STATUS_SUCCESS;
}
