/* A stand-in for the CUDA driver (libcuda.so.1) with the entry points lowbitcc's C++ replay of a
 * host record calls (backend/csrc/launch_replay.h), for tests without a GPU
 * (tests/backend/test_launch_replay.py): each call is appended as one line to the file that
 * FAKE_CUDA_LOG names. A launch writes its handle, grid, block, shared bytes and stream, and
 * each parameter's bytes in hex, as many as FAKE_CUDA_SIZES_<handle> (comma-separated bytes
 * per parameter) says the kernel takes, as the real driver reads them from the kernel's image.
 * A launch of handle 0xBAD fails with 700 (CUDA_ERROR_ILLEGAL_ADDRESS). Contexts: one current
 * context per thread, none at first; a device's primary context is 0x1000 + its ordinal. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static __thread void* current_context = NULL;

static void log_line(const char* text) {
  const char* path = getenv("FAKE_CUDA_LOG");
  FILE* f = path ? fopen(path, "a") : NULL;
  if (f) {
    fputs(text, f);
    fputc('\n', f);
    fclose(f);
  }
}

int cuGetErrorName(int error, const char** name) {
  *name = error == 700 ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_UNKNOWN";
  return 0;
}

int cuCtxGetCurrent(void** context) {
  *context = current_context;
  return 0;
}

int cuCtxSetCurrent(void* context) {
  char line[64];
  snprintf(line, sizeof line, "set %p", context);
  log_line(line);
  current_context = context;
  return 0;
}

int cuDeviceGet(int* device, int ordinal) {
  *device = ordinal;
  return 0;
}

int cuDevicePrimaryCtxRetain(void** context, int device) {
  char line[64];
  snprintf(line, sizeof line, "retain %d", device);
  log_line(line);
  *context = (void*)(0x1000L + device);
  return 0;
}

int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
  char line[4096], name[64];
  int at = snprintf(line, sizeof line, "launch %lx %u %u %u %u %u %u %u %lx %s", (long)f, gx,
                    gy, gz, bx, by, bz, shared, (long)stream, extra ? "extra" : "-");
  snprintf(name, sizeof name, "FAKE_CUDA_SIZES_%lx", (long)f);
  const char* sizes = getenv(name);
  for (int i = 0; sizes && *sizes; ++i) {
    long size = strtol(sizes, (char**)&sizes, 10);
    at += snprintf(line + at, sizeof line - at, " ");
    for (long b = 0; b < size; ++b) {
      at += snprintf(line + at, sizeof line - at, "%02x", ((unsigned char*)params[i])[b]);
    }
    if (*sizes == ',') {
      ++sizes;
    }
  }
  log_line(line);
  return f == (void*)0xBAD ? 700 : 0;
}
