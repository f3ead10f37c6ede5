// `LaunchReplay`: a call place's host record (lowbitcc/backend/launch_record.py) issued from C++:
// the record's CUDA launches made by the CUDA driver's `cuLaunchKernel` on the kernels CuPy
// compiled (their `CUfunction` handles, CuPy's `Function.ptr`) with the very argument bytes the
// record was made with, and its transfers issued on the inner c10d backend (ProcessGroupNCCL,
// in synchronous mode: on the current stream), in record order, on the stream the caller names.
// One call from Python (`replay`, the GIL released) in place of a CuPy launch and a Python
// collective call per step.
//
// Steps, in record order:
// - a kernel: its handle, grid (x, y), threads per block, and each argument's bytes (as CuPy
//   passes a NumPy scalar: its `tobytes()`), each kept 16-byte aligned; the driver copies each
//   parameter's size, which it reads from the kernel's image, from there;
// - a transfer: `_allgather_base` or `alltoall_base` of `send` into `recv` on a `c10d::Backend`,
//   `asyncOp` false, then the Work's `wait()` where the backend returns one (the current stream
//   ordered after it, as nccl.py's `Prepared.issue_ordered`); its host seconds are summed and
//   returned, for the transfer's metering in Python (`counters.Stats.add_sent`);
// - a Python callable, called with the GIL (a step the record could not hand to C++: a launch
//   with arguments other than NumPy scalars, a transfer over a stand-in group).
//
// The driver is found in the process at the first launch (`libcuda.so.1`, which torch's CUDA
// build and CuPy load; `dlopen` with RTLD_NOLOAD first). A replay's launches run in the
// device's primary context (where CuPy loaded the kernels, whose default stream is torch's
// stream 0 there): made current for them where the thread has none (as CuPy's launch does) or
// another device's (then made current again after them).
// Where the replay was made with a recorder (a Python list, or any object with `append`: tests
// and probes without a GPU), each launch is appended to it as
// `(function, (grid_x, grid_y), block, stream, [argument bytes])` instead, with the GIL.
//
// Threads: one call at a time (the place's issuing thread); `replay` runs without the GIL and
// takes it only for Python steps and a recorder.
#pragma once

#include <dlfcn.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace lowbitcc {

// The CUDA driver's entry points a replay uses, found once per process.
class CudaDriver {
 public:
  // CUresult cuLaunchKernel(CUfunction, gridDim{X,Y,Z}, blockDim{X,Y,Z}, sharedMemBytes,
  // CUstream, void** kernelParams, void** extra); CUresult is an int-sized enum.
  using LaunchKernel = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, void*, void**, void**);
  using ErrorName = int (*)(int, const char**);
  using ContextGet = int (*)(void**);          // cuCtxGetCurrent(CUcontext*)
  using ContextSet = int (*)(void*);           // cuCtxSetCurrent(CUcontext)
  using ContextDevice = int (*)(int*);         // cuCtxGetDevice(CUdevice*)
  using DeviceGet = int (*)(int*, int);        // cuDeviceGet(CUdevice*, ordinal)
  using PrimaryRetain = int (*)(void**, int);  // cuDevicePrimaryCtxRetain(CUcontext*, CUdevice)

  static constexpr const char* kNoDriver =
      "lowbitcc: a host record's launch needs the CUDA driver (libcuda.so.1), which this "
      "process has not loaded";

  static const CudaDriver& get() {
    static const CudaDriver driver;
    return driver;
  }

  void launch(void* function, unsigned grid_x, unsigned grid_y, unsigned block, void* stream,
              void** params) const {
    if (launch_ == nullptr) {
      throw std::runtime_error(kNoDriver);
    }
    check(launch_(function, grid_x, grid_y, 1, block, 1, 1, 0, stream, params, nullptr),
          "cuLaunchKernel of a host record's step");
  }

  // Make `device`'s primary context (the one torch and CuPy use, where CuPy loaded the
  // kernels) current on the calling thread where it is not: where the thread has no context
  // (its first CUDA work is a replay), as CuPy's launch does first (`_ensure_context`), or
  // another device's (the launches, on stream 0 in particular, would go there). Returns the
  // context to make current again after the launches (another device's), else nullptr.
  void* enter_context(int64_t device) const {
    if (context_get_ == nullptr || context_set_ == nullptr || context_device_ == nullptr ||
        device_get_ == nullptr || primary_retain_ == nullptr) {
      throw std::runtime_error(kNoDriver);
    }
    void* previous = nullptr;
    check(context_get_(&previous), "cuCtxGetCurrent");
    int handle = 0;
    check(device_get_(&handle, static_cast<int>(device)), "cuDeviceGet");
    if (previous != nullptr) {
      int current = -1;
      check(context_device_(&current), "cuCtxGetDevice");
      if (current == handle) {
        return nullptr;
      }
    }
    void* context = nullptr;
    check(primary_retain_(&context, handle), "cuDevicePrimaryCtxRetain");  // kept: torch's too
    check(context_set_(context), "cuCtxSetCurrent");
    return previous;
  }

  // Make `previous` (from `enter_context`) current again.
  void leave_context(void* previous) const noexcept {
    if (previous != nullptr) {
      context_set_(previous);
    }
  }

 private:
  CudaDriver() {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) {
      library = dlopen("libcuda.so.1", RTLD_NOW);
    }
    if (library != nullptr) {  // kept open for the process
      launch_ = reinterpret_cast<LaunchKernel>(dlsym(library, "cuLaunchKernel"));
      error_name_ = reinterpret_cast<ErrorName>(dlsym(library, "cuGetErrorName"));
      context_get_ = reinterpret_cast<ContextGet>(dlsym(library, "cuCtxGetCurrent"));
      context_set_ = reinterpret_cast<ContextSet>(dlsym(library, "cuCtxSetCurrent"));
      context_device_ = reinterpret_cast<ContextDevice>(dlsym(library, "cuCtxGetDevice"));
      device_get_ = reinterpret_cast<DeviceGet>(dlsym(library, "cuDeviceGet"));
      primary_retain_ =
          reinterpret_cast<PrimaryRetain>(dlsym(library, "cuDevicePrimaryCtxRetain"));
    }
  }

  // Throw what `result` (a CUresult) names where it is not CUDA_SUCCESS.
  void check(int result, const char* what) const {
    if (result == 0) {
      return;
    }
    const char* name = nullptr;
    if (error_name_ == nullptr || error_name_(result, &name) != 0 || name == nullptr) {
      name = "an unknown CUresult";
    }
    throw std::runtime_error(std::string("lowbitcc: ") + what + " failed: " + name + " (" +
                             std::to_string(result) + ")");
  }

  LaunchKernel launch_ = nullptr;
  ErrorName error_name_ = nullptr;
  ContextGet context_get_ = nullptr;
  ContextSet context_set_ = nullptr;
  ContextDevice context_device_ = nullptr;
  DeviceGet device_get_ = nullptr;
  PrimaryRetain primary_retain_ = nullptr;
};

class LaunchReplay {
 public:
  // `device`: the CUDA device index the launches go to (its primary context made current where
  // the thread has none), or -1 (a recorder's replay); `recorder`: None, or a list launches go
  // to instead.
  LaunchReplay(int64_t device, py::object recorder)
      : device_(device), recorder_(std::move(recorder)) {}

  // A launch of `function` on `grid_x` x `grid_y` blocks of `block` threads with `args`.
  void add_kernel(uint64_t function, unsigned grid_x, unsigned grid_y, unsigned block,
                  const std::vector<std::string>& args) {
    Step step;
    step.kind = Step::kKernel;
    step.function = function;
    step.grid_x = grid_x;
    step.grid_y = grid_y;
    step.block = block;
    size_t blocks = 0;
    for (const std::string& arg : args) {
      blocks += aligned_blocks(arg.size());
    }
    step.storage.resize(blocks);  // sized once: the pointers below stay valid
    size_t at = 0;
    for (const std::string& arg : args) {
      auto* place = reinterpret_cast<unsigned char*>(step.storage.data() + at);
      std::memcpy(place, arg.data(), arg.size());
      step.params.push_back(place);
      step.sizes.push_back(arg.size());
      at += aligned_blocks(arg.size());
    }
    steps_.push_back(std::move(step));
    ++kernels_;
  }

  // A transfer of `send` into `recv` on `backend`: an all-gather, or with `all_to_all` an
  // all-to-all of equal rows.
  void add_transfer(c10::intrusive_ptr<c10d::Backend> backend, bool all_to_all, at::Tensor recv,
                    at::Tensor send) {
    Step step;
    step.kind = all_to_all ? Step::kAllToAll : Step::kAllGather;
    step.backend = std::move(backend);
    step.recv = std::move(recv);
    step.send = std::move(send);
    steps_.push_back(std::move(step));
  }

  // A step Python makes (called without arguments, with the GIL).
  void add_call(py::object call) {
    Step step;
    step.kind = Step::kCall;
    step.call = std::move(call);
    steps_.push_back(std::move(step));
  }

  // Issue every step in order on `stream` (a `cudaStream_t`; 0: the legacy default stream);
  // returns the seconds spent issuing its transfers. Called without the GIL.
  double replay(uint64_t stream) {
    Entered entered;
    if (device_ >= 0 && recorder_.is_none() && kernels_ > 0) {
      entered.previous = CudaDriver::get().enter_context(device_);
    }
    double transfer_s = 0.0;
    for (Step& step : steps_) {
      switch (step.kind) {
        case Step::kKernel:
          launch(step, stream);
          break;
        case Step::kAllGather:
        case Step::kAllToAll: {
          auto start = std::chrono::steady_clock::now();
          transfer(step);
          transfer_s +=
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          break;
        }
        case Step::kCall: {
          py::gil_scoped_acquire gil;
          step.call();
          break;
        }
      }
    }
    return transfer_s;
  }

  size_t size() const { return steps_.size(); }

  // How many steps are made in C++ (kernels and transfers), not by Python.
  size_t native_steps() const {
    size_t n = 0;
    for (const Step& step : steps_) {
      n += step.kind != Step::kCall;
    }
    return n;
  }

 private:
  struct alignas(16) Aligned {
    unsigned char bytes[16];
  };

  // The `Aligned` blocks `bytes` take.
  static size_t aligned_blocks(size_t bytes) {
    return (bytes + sizeof(Aligned) - 1) / sizeof(Aligned);
  }

  // Makes the context a replay found current again when it ends (`CudaDriver::enter_context`).
  struct Entered {
    void* previous = nullptr;
    Entered() = default;
    Entered(const Entered&) = delete;
    Entered& operator=(const Entered&) = delete;
    ~Entered() {
      if (previous != nullptr) {
        CudaDriver::get().leave_context(previous);
      }
    }
  };

  struct Step {
    enum Kind { kKernel, kAllGather, kAllToAll, kCall } kind = kCall;
    uint64_t function = 0;
    unsigned grid_x = 0, grid_y = 0, block = 0;
    std::vector<Aligned> storage;  // each argument from a 16-byte boundary
    std::vector<void*> params;     // where each argument lies in `storage`
    std::vector<size_t> sizes;     // each argument's bytes
    c10::intrusive_ptr<c10d::Backend> backend;
    at::Tensor recv, send;
    py::object call;
  };

  void launch(Step& step, uint64_t stream) {
    if (!recorder_.is_none()) {
      py::gil_scoped_acquire gil;
      py::list args;
      for (size_t i = 0; i < step.params.size(); ++i) {
        args.append(py::bytes(static_cast<const char*>(step.params[i]), step.sizes[i]));
      }
      recorder_.attr("append")(py::make_tuple(step.function,
                                              py::make_tuple(step.grid_x, step.grid_y),
                                              step.block, stream, args));
      return;
    }
    CudaDriver::get().launch(reinterpret_cast<void*>(step.function), step.grid_x, step.grid_y,
                             step.block, reinterpret_cast<void*>(stream), step.params.data());
  }

  static void transfer(Step& step) {
    c10::intrusive_ptr<c10d::Work> work;
    if (step.kind == Step::kAllGather) {
      c10d::AllgatherOptions opts;
      opts.asyncOp = false;
      work = step.backend->_allgather_base(step.recv, step.send, opts);
    } else {
      c10d::AllToAllOptions opts;
      opts.asyncOp = false;
      std::vector<int64_t> equal_rows;
      work = step.backend->alltoall_base(step.recv, step.send, equal_rows, equal_rows, opts);
    }
    if (work) {
      work->wait();
    }
  }

  int64_t device_;
  py::object recorder_;
  std::vector<Step> steps_;
  size_t kernels_ = 0;
};

}  // namespace lowbitcc
