/*
 * A fake libamdhip64.so for simulated AMD GPUs: the part of HIP's runtime API that tells which
 * devices a process enumerates, in which order (hipInit, hipGetDeviceCount, hipDeviceGet,
 * hipDeviceGetUuid), on the machine of $PYTEST_GPU_SIM_LEDGER/nvml.state (format:
 * pytest_gpu.sim.nvml; an AMD machine says "option vendor amd").
 *
 * Modelled on ROCm/clr at f9f995c6d0aecec28debd3db0f41df0c15ec003d (2024-10-22):
 * - hipamd/src/hip_internal.hpp (HIP_INIT, HIP_INIT_API): the runtime initialises once, at the
 *   first API call, and fixes its device list then; if that fails an API answers
 *   hipErrorInvalidDevice, and with no device hipErrorNoDevice (hipGetDeviceCount initialises
 *   without returning early, and answers hipErrorNoDevice itself with *count = 0).
 * - hipamd/src/hip_context.cpp (hipInit: flags must be 0), hip_device.cpp (hipDeviceGet,
 *   hipDeviceGetUuid: invalid ordinal, then a NULL pointer), hip_device_runtime.cpp.
 * - rocclr/device/rocm/rocdevice.cpp: HIP narrows what ROCr enumerates by HIP_VISIBLE_DEVICES,
 *   or CUDA_VISIBLE_DEVICES when HIP's is empty or unset (GPU_DEVICE_ORDINAL is OpenCL's, not
 *   HIP's); an empty value narrows nothing; an entry "GPU-..." is the first device whose
 *   UUID contains it, else an index, which must be written exactly ("1", not "01" or " 1");
 *   an invalid entry ends the list and a repeated one is skipped. A device's UUID (hipUUID's 16
 *   bytes) is ROCr's "GPU-<16 hex>" less "GPU-": 16 ASCII hex digits, not binary.
 * Versions: $PYTEST_GPU_SIM_ROCM ("6.1.0", "6.2.0", ...; unset: the newest) picks the clr modelled.
 * clr learned UUIDs in HIP_VISIBLE_DEVICES in 52db98ed (2024-04-08, "Add UUID support for
 * HIP_VISIBLE_DEVICES on Linux"), first released in rocm-6.2.0 (34a5465f). Before it (rocm-6.1.0,
 * a43fa3e4) every entry is read as an index: "GPU-..." is invalid and ends the list, so a UUID
 * first in the variable leaves the process no device.
 * A GPU without a unique id (state file "option amd_no_uuid 1,3") is "GPU-XX" to HIP
 * (amd_gpu_agent.cpp's HSA_AMD_AGENT_INFO_UUID) and "Invalid-UUID", which nothing matches, to
 * ROCr's RvdFilter (amd_filter_device.cpp's BuildDeviceUuidList): it is chosen by index only.
 * ROCr's own enumeration (hsa_id order: "option amd_rocr_order", as the fake libamd_smi.so
 * reads it) narrowed by ROCR_VISIBLE_DEVICES follows ROCm/ROCR-Runtime at c7785a6d (2024-10-23),
 * core/inc/amd_filter_device.h and core/runtime/amd_filter_device.cpp (RvdFilter), as
 * pytest_gpu.gpu.rocm.select does: entries trimmed, indices or a unique UUID prefix in any case;
 * an empty value hides all; an entry that names none, or one already chosen, ends the list.
 * (ROCr reads an index with strtol base 0, so "0x1" names GPU 1 and "010" GPU 8 there; here
 * indices are decimal.)
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define API __attribute__((visibility("default")))
#define MAX_GPUS 64
#define LINE_LEN 4096

typedef int hipError_t;
typedef int hipDevice_t;
typedef struct hipUUID_t { char bytes[16]; } hipUUID;

enum { hipSuccess = 0, hipErrorInvalidValue = 1, hipErrorNoDevice = 100, hipErrorInvalidDevice = 101 };

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_ok;                        /* the runtime initialised (an AMD machine's state file) */
static int g_count;                     /* devices this process enumerates */
static char g_uuid[MAX_GPUS][21];       /* their ROCr UUIDs, "GPU-<16 hex>", in HIP's order */

/* clr before rocm-6.2.0 reads no UUID in HIP_VISIBLE_DEVICES ($PYTEST_GPU_SIM_ROCM) */
static int hip_takes_uuids(void) {
    const char *v = getenv("PYTEST_GPU_SIM_ROCM");
    int major = 0, minor = 0;
    if (!v || !*v || sscanf(v, "%d.%d", &major, &minor) < 1) return 1;
    return major > 6 || (major == 6 && minor >= 2);
}

/* A ROCr-order list of UUIDs narrowed by ROCR_VISIBLE_DEVICES (RvdFilter, as rocm.select models it). */
static int rocr_select(char (*list)[21], int n, const char *value, char (*out)[21]) {
    int chosen[MAX_GPUS], k = 0;
    if (!*value) return 0;
    char *copy = strdup(value);
    if (!copy) return 0;
    /* strtok_r would skip empty entries: split by hand so "0,,1" ends at the empty one */
    for (char *entry = copy, *next; entry; entry = next) {
        next = strchr(entry, ',');
        if (next) *next++ = '\0';
        while (*entry == ' ' || *entry == '\t') entry++;
        size_t len = strlen(entry);
        while (len && (entry[len - 1] == ' ' || entry[len - 1] == '\t')) entry[--len] = '\0';
        int match = -1;
        if (len && strspn(entry, "0123456789") == len) {
            long position = strtol(entry, NULL, 10);
            if (position < n) match = (int)position;
        } else if (len > 4 && !strncasecmp(entry, "GPU-", 4)) {
            int found = 0;
            for (int i = 0; i < n; i++)  /* "Invalid-UUID" for a GPU without one: never matched */
                if (strncmp(list[i], "GPU-XX", 7) && !strncasecmp(list[i], entry, len)) { match = i; found++; }
            if (found != 1) match = -1;
        }
        int again = 0;
        for (int j = 0; j < k; j++) again |= chosen[j] == match;
        if (match < 0 || again) break;
        chosen[k++] = match;
    }
    free(copy);
    for (int j = 0; j < k; j++) memcpy(out[j], list[chosen[j]], 21);
    return k;
}

/* rocdevice.cpp's HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES over what ROCr left. */
static int hip_select(char (*list)[21], int n, const char *ordinals, char (*out)[21]) {
    if (!ordinals || !*ordinals) {
        memmove(out, list, (size_t)n * 21);
        return n;
    }
    int chosen[MAX_GPUS], k = 0;
    size_t pos = 0, size = strlen(ordinals);
    do {
        size_t end = strcspn(ordinals + pos, ",") + pos;
        char id[LINE_LEN];
        size_t len = end - pos < sizeof id - 1 ? end - pos : sizeof id - 1;
        memcpy(id, ordinals + pos, len);
        id[len] = '\0';
        if (hip_takes_uuids() && strstr(id, "GPU-")) { /* a UUID: the first device whose UUID contains it, as its index */
            for (int i = 0; i < n; i++)
                if (strstr(list[i], id)) { snprintf(id, sizeof id, "%d", i); break; }
        }
        int index = atoi(id);
        char again[32];
        snprintf(again, sizeof again, "%d", index);
        if (index < 0 || index >= n || strcmp(id, again)) break; /* the rest is discarded */
        int seen = 0;
        for (int j = 0; j < k; j++) seen |= chosen[j] == index;
        if (!seen) chosen[k++] = index;
        pos = end + 1;
    } while (pos < size);
    for (int j = 0; j < k; j++) memcpy(out[j], list[chosen[j]], 21);
    return k;
}

static void init_once(void) {
    const char *dir = getenv("PYTEST_GPU_SIM_LEDGER");
    char path[4096], line[LINE_LEN];
    if (!dir || !*dir || snprintf(path, sizeof path, "%s/nvml.state", dir) >= (int)sizeof path) return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char uuids[MAX_GPUS][21];
    int place[MAX_GPUS], no_uuid[MAX_GPUS] = {0}, n = 0, amd = 0, ordered = 0;
    for (int i = 0; i < MAX_GPUS; i++) place[i] = -1;
    while (fgets(line, sizeof line, f)) {
        char kind[32], key[64], value[LINE_LEN], uuid[64];
        unsigned int index;
        if (sscanf(line, "%31s %63s %4095s", kind, key, value) == 3 && !strcmp(kind, "option")) {
            if (!strcmp(key, "vendor")) amd = !strcmp(value, "amd");
            if (!strcmp(key, "amd_rocr_order")) { /* "3,0,1,2": GPU 3 is ROCr's first */
                int p = 0;
                for (char *item = strtok(value, ","); item && p < MAX_GPUS; item = strtok(NULL, ","))
                    if ((unsigned)atoi(item) < MAX_GPUS) place[atoi(item)] = p++;
                ordered = 1;
            }
            if (!strcmp(key, "amd_no_uuid")) /* "1,3": GPUs whose unique id is 0 */
                for (char *item = strtok(value, ","); item; item = strtok(NULL, ","))
                    if ((unsigned)atoi(item) < MAX_GPUS) no_uuid[atoi(item)] = 1;
        } else if (sscanf(line, "gpu %u %63s", &index, uuid) == 2 && index == (unsigned)n && n < MAX_GPUS &&
                   strlen(uuid) == 20 && !strncmp(uuid, "GPU-", 4)) {
            memcpy(uuids[n++], uuid, 21);
        }
    }
    fclose(f);
    if (!amd) return; /* no amdgpu: ROCr, and so HIP, cannot initialise */
    for (int i = 0; i < n; i++)
        if (no_uuid[i]) { /* clr copies 16 bytes after "GPU-" from a zeroed buffer: "XX" and 14 NULs */
            memset(uuids[i], 0, 21);
            memcpy(uuids[i], "GPU-XX", 6);
        }
    char rocr[MAX_GPUS][21], left[MAX_GPUS][21];
    for (int i = 0; i < n; i++) memcpy(rocr[ordered && place[i] >= 0 ? place[i] : i], uuids[i], 21);
    const char *rvd = getenv("ROCR_VISIBLE_DEVICES");
    int k = rvd ? rocr_select(rocr, n, rvd, left) : (memcpy(left, rocr, sizeof rocr), n);
    const char *hip = getenv("HIP_VISIBLE_DEVICES");
    g_count = hip_select(left, k, hip && *hip ? hip : getenv("CUDA_VISIBLE_DEVICES"), g_uuid);
    g_ok = 1;
}

/* HIP_INIT_API: initialise once; a failed start is hipErrorInvalidDevice, no device hipErrorNoDevice */
static hipError_t enter(void) {
    pthread_once(&g_once, init_once);
    if (!g_ok) return hipErrorInvalidDevice;
    return g_count ? hipSuccess : hipErrorNoDevice;
}

API hipError_t hipInit(unsigned int flags) {
    hipError_t r = enter();
    if (r) return r;
    return flags ? hipErrorInvalidValue : hipSuccess;
}

API hipError_t hipGetDeviceCount(int *count) {
    pthread_once(&g_once, init_once); /* HIP_INIT_API_NO_RETURN */
    if (!count) return hipErrorInvalidValue;
    *count = g_count;
    return g_count < 1 ? hipErrorNoDevice : hipSuccess;
}

API hipError_t hipDeviceGet(hipDevice_t *device, int ordinal) {
    hipError_t r = enter();
    if (r) return r;
    if (!device) return hipErrorInvalidValue;
    if (ordinal < 0 || ordinal >= g_count) return hipErrorInvalidDevice;
    *device = ordinal;
    return hipSuccess;
}

API hipError_t hipDeviceGetUuid(hipUUID *uuid, hipDevice_t device) {
    hipError_t r = enter();
    if (r) return r;
    if (device < 0 || device >= g_count) return hipErrorInvalidDevice;
    if (!uuid) return hipErrorInvalidValue;
    memcpy(uuid->bytes, g_uuid[device] + 4, 16); /* the hex digits, as ASCII */
    return hipSuccess;
}
