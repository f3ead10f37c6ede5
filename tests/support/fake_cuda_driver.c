/* A stand-in for the CUDA driver (libcuda.so.1) with the entry points lowbitcc's C++ replay of a
 * host record calls (backend/csrc/launch_replay.h), for tests without a GPU
 * (tests/backend/test_launch_replay.py): each call is appended as one line to the file that
 * FAKE_CUDA_LOG names. A launch writes its handle, grid, block, shared bytes and stream, and
 * each parameter's bytes in hex, as many as FAKE_CUDA_SIZES_<handle> (comma-separated bytes
 * per parameter) says the kernel takes, as the real driver reads them from the kernel's image.
 * A launch of handle 0xBAD fails with 700 (CUDA_ERROR_ILLEGAL_ADDRESS). Contexts: one current
 * context per thread, none at first; device d's primary context is 0x1000 + d.
 * `lowbitcc_fake_cuda_driver` marks this library (the test checks it is the one loaded). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int lowbitcc_fake_cuda_driver = 1;

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

int cuCtxGetDevice(int* device) {
  if (current_context == NULL) {
    return 201; /* CUDA_ERROR_INVALID_CONTEXT */
  }
  *device = (int)((uintptr_t)current_context - 0x1000);
  return 0;
}

int cuCtxSetCurrent(void* context) {
  char line[64];
  snprintf(line, sizeof line, "set %#lx", (unsigned long)(uintptr_t)context);
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
  *context = (void*)(uintptr_t)(0x1000 + device);
  return 0;
}

int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void* stream, void** params, void** extra) {
  char line[4096], name[64];
  size_t at = 0;
  at += snprintf(line, sizeof line, "launch %lx %u %u %u %u %u %u %u %lx %s",
                 (unsigned long)(uintptr_t)f, gx, gy, gz, bx, by, bz, shared,
                 (unsigned long)(uintptr_t)stream, extra ? "extra" : "-");
  snprintf(name, sizeof name, "FAKE_CUDA_SIZES_%lx", (unsigned long)(uintptr_t)f);
  const char* sizes = getenv(name);
  for (int i = 0; sizes != NULL && *sizes != '\0' && i < 64; ++i) {
    char* end = NULL;
    long size = strtol(sizes, &end, 10);
    if (end == sizes) {
      break; /* not a number: the rest is ignored */
    }
    for (long b = -1; b < size && at + 3 < sizeof line; ++b) {
      at += b < 0 ? snprintf(line + at, sizeof line - at, " ")
                  : snprintf(line + at, sizeof line - at, "%02x",
                             ((unsigned char*)params[i])[b]);
    }
    sizes = *end == ',' ? end + 1 : end;
  }
  log_line(line);
  return f == (void*)0xBAD ? 700 : 0;
}
