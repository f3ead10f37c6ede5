// PlanCore: the steady run of one call place's compressed all-reduce on the CPU, in C++: what
// `call_plan.CallPlan.run` does on the direct schedule's two-rank all-gather of one chunk
// (lowbitcc/schedules/direct.py, `_gather_all_reduce`), without Python.
//
// A place's plan gets one (lowbitcc/backend/plan_cores.py builds it from the plan's kept
// buffers and settings) where its runs are that schedule: 2 ranks, one chunk, no error
// feedback, nearest rounding, the C++ codec. `run` is one call:
//   - in the calling thread, the GIL released: the header with the call number, the encode of
//     both rows of the source into the plan's messages (codec_api.h), their frame, and the
//     all-gather of the messages into the plan's received buffer, started on the plan's inner
//     gloo group;
//   - when the all-gather completes, on the thread gloo completes it on: each row's two
//     messages verified against the call and decoded, summed in rank order, into the source
//     (straight where it is fp32 and the row whole, else through the plan's fp32 scratch and a
//     cast), as the Python schedule does. Where a message does not belong to the call, the
//     whole decode is the Python plan's instead (`CallPlan.finish_received`, with the GIL): it
//     writes what the Python path writes and raises the same error, which the call's future
//     carries.
// The run's Work (`PlannedWork`) completes with the decode. The same bytes
// as the Python path, on the same buffers, so a place's runs may take either path: one run of a
// place at a time (`wait`, which the runner and the Python plan call before a run).
//
// Threads: `run` is called with the GIL held (the caller's); the decode runs on gloo's thread
// and touches no Python object except in the failure path. What a run measured (codec and wire
// seconds, the cost model's time) is kept here under `mutex_` and handed to the statistics by
// the runner at its next compressed call (`take_timings`).
#pragma once

#include <torch/csrc/Dtype.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "codec_api.h"

namespace lowbitcc {

// The Work of a plan core's run: done when its decode is (`future`, whose value is the call's
// outputs, or its error what the decode raised); `wait` raises that error, as the Python path's
// Work does.
class PlannedWork : public c10d::Work {
 public:
  explicit PlannedWork(c10::intrusive_ptr<c10::ivalue::Future> future)
      : c10d::Work(-1, c10d::OpType::ALLREDUCE), future_(std::move(future)) {}

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->completed() ? future_->exception_ptr() : nullptr;
  }
  // (`timeout`: as gloo's Work, a wait that outlasts it raises; the call goes on.)
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout != ::kNoTimeout) {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (!future_->completed()) {
        TORCH_CHECK(std::chrono::steady_clock::now() < deadline,
                    "lowbitcc: a compressed call did not complete within its wait's timeout (",
                    timeout.count(), " ms)");
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
    future_->waitAndThrow();
    return true;
  }
  void synchronize() override {}
  std::vector<at::Tensor> result() override {
    future_->waitAndThrow();
    return future_->value().toTensorVector();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// What runs measured and the runner has not yet handed to the statistics and the cost model.
struct RunTimings {
  double codec_s = 0.0;
  double wire_s = 0.0;
  std::vector<double> modelled_s;  // each timed run's wall time, for the cost model
};

class __attribute__((visibility("hidden"))) PlanCore
    : public std::enable_shared_from_this<PlanCore> {
 public:
  // `transport`: the plan's inner gloo group; `spec`: plan_cores.py's `core_spec` (its
  // docstring names each entry); `api`: the codec's `codec_api` capsule.
  PlanCore(c10::intrusive_ptr<c10d::Backend> transport, py::dict spec, py::capsule api)
      : transport_(std::move(transport)),
        plan_(py::weakref(spec["plan"])),
        size_class_(spec["size_class"]),
        messages_(spec["messages"].cast<at::Tensor>()),
        nonfinite_(spec["nonfinite"].cast<at::Tensor>()),
        received_(spec["received"].cast<at::Tensor>()),
        scratch_(spec["scratch"].cast<at::Tensor>()),
        header_(spec["header"].cast<std::string>()),
        dtype_(reinterpret_cast<THPDtype*>(spec["dtype"].ptr())->scalar_type),
        numel_(spec["numel"].cast<int64_t>()),
        m_(spec["m"].cast<int64_t>()),
        world_(spec["world"].cast<int64_t>()),
        bits_(spec["bits"].cast<int64_t>()),
        group_size_(spec["group_size"].cast<int64_t>()),
        format_(spec["format"].cast<int64_t>()),
        used_(spec["used"].cast<int64_t>()),
        step_(spec["step"].cast<int64_t>()),
        seq_offset_(spec["seq_offset"].cast<int64_t>()),
        factor_(spec["factor"].cast<double>()),
        beta_(spec["beta"].cast<double>()),
        checksum_(spec["checksum"].cast<bool>()),
        modelled_(spec["modelled"].cast<bool>()),
        nbytes_(spec["nbytes"].cast<int64_t>()),
        logical_bytes_(spec["logical_bytes"].cast<int64_t>()),
        intra_bytes_(spec["intra_node_bytes"].cast<int64_t>()),
        inter_bytes_(spec["inter_node_bytes"].cast<int64_t>()) {
    api_ = static_cast<const lowbitcc_cpu::CodecApi*>(
        PyCapsule_GetPointer(api.ptr(), lowbitcc_cpu::kCodecApiName));
    if (api_ == nullptr) {
      throw py::error_already_set();
    }
    TORCH_CHECK(api_->version == lowbitcc_cpu::kCodecApiVersion, "lowbitcc: the C++ codec's API ",
                api_->version, " is not the runner's ", lowbitcc_cpu::kCodecApiVersion);
    TORCH_CHECK(world_ == 2 && (int64_t)header_.size() == loco::kHeaderBytes &&
                    messages_.is_contiguous() && messages_.size(0) == world_ &&
                    received_.numel() == world_ * messages_.numel() &&
                    scratch_.numel() == m_ && scratch_.scalar_type() == at::kFloat,
                "lowbitcc: a plan core's buffers do not fit its call");
  }

  PlanCore(const PlanCore&) = delete;
  PlanCore& operator=(const PlanCore&) = delete;

  // Its last reference may go on gloo's thread (a run's callback): the Python objects it keeps
  // are let go with the GIL.
  ~PlanCore() {
    if (!Py_IsInitialized()) {
      plan_.release();
      size_class_.release();
      return;
    }
    py::gil_scoped_acquire acquire;
    plan_ = py::object();
    size_class_ = py::object();
  }

  // Whether a run of `tensor` (the call's source, checked by the runner to be a dense CPU
  // tensor) is this plan's: its dtype and number of elements, contiguous.
  bool fits(const at::Tensor& tensor) const {
    return tensor.scalar_type() == dtype_ && tensor.numel() == numel_ && tensor.is_contiguous();
  }

  bool modelled() const { return modelled_; }
  const py::object& size_class() const { return size_class_; }
  int64_t nbytes() const { return nbytes_; }
  int64_t logical_bytes() const { return logical_bytes_; }
  int64_t wire_bytes() const { return intra_bytes_ + inter_bytes_; }
  int64_t intra_node_bytes() const { return intra_bytes_; }
  int64_t inter_node_bytes() const { return inter_bytes_; }

  // Wait (without the GIL: the caller releases it) until the place's last C++ run is done,
  // so that nothing else writes its buffers meanwhile. Its errors are its Work's, not this.
  void wait() {
    c10::intrusive_ptr<c10::ivalue::Future> last;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      last = last_;
    }
    if (last) {
      last->wait();
    }
  }

  // Whether the place's last C++ run is done (or there was none).
  bool idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !last_ || last_->completed();
  }

  // One run (see the file's comment): all-reduce `tensor` in place as call number `seq`, its
  // encode's residual sums added into `sums` (the calling thread's statistics accumulator);
  // `timed`: its wall time goes to the cost model. Called with the GIL held; its Work.
  c10::intrusive_ptr<c10d::Work> run(const at::Tensor& tensor, int64_t seq, at::Tensor sums,
                                     bool timed) {
    auto self = shared_from_this();
    py::gil_scoped_release release;
    const auto start = std::chrono::steady_clock::now();
    const int threads = at::get_num_threads();
    std::string header = header_;
    const uint32_t seq32 = static_cast<uint32_t>(seq);
    std::memcpy(&header[seq_offset_], &seq32, 4);
    at::Tensor flat = tensor.view({-1});
    loco::EncodeArgs a{};
    a.src = flat.data_ptr();
    a.msgs = messages_.data_ptr<uint8_t>();
    a.nonfinite = nonfinite_.data_ptr<uint8_t>();
    a.sums = sums.data_ptr<double>();
    a.numel = numel_;
    a.rows = world_;
    a.m = m_;
    a.ng = (m_ + group_size_ - 1) / group_size_;
    a.P = messages_.size(1);
    a.factor = static_cast<float>(factor_);
    a.scale_input = factor_ != 1.0;
    a.beta = static_cast<float>(beta_);
    a.omb = static_cast<float>(1.0 - beta_);
    a.G = static_cast<int32_t>(group_size_);
    a.mode = loco::kErrorNone;
    a.format = static_cast<int32_t>(format_);
    api_->encode(a, bits_, threads, dtype_);
    api_->frame(messages_, header, shards_all_, nonfinite_, used_, 0, checksum_, step_, threads);
    const auto encoded = std::chrono::steady_clock::now();
    c10d::AllgatherOptions options;
    at::Tensor sent = messages_.view({-1});
    auto gather = transport_->_allgather_base(received_, sent, options);
    const auto issued = std::chrono::steady_clock::now();
    auto decoded = gather->getFuture()->then(
        [self, flat, tensor, seq, header, threads, start, timed,
         encode_s = seconds(start, encoded), issue_s = seconds(encoded, issued)](
            c10::ivalue::Future& done) -> c10::IValue {
          if (done.hasError()) {
            std::rethrow_exception(done.exception_ptr());
          }
          self->decode(flat, tensor, seq, header, threads, start, timed, encode_s + issue_s);
          return c10::IValue(std::vector<at::Tensor>{tensor});
        },
        c10::ListType::create(c10::TensorType::get()));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      last_ = decoded;
    }
    return c10::make_intrusive<PlannedWork>(decoded);
  }

  // What runs measured since the last call (see the file's comment), handed over once.
  RunTimings take_timings() {
    std::lock_guard<std::mutex> lock(mutex_);
    RunTimings taken = std::move(timings_);
    timings_ = RunTimings();
    return taken;
  }

 private:
  static double seconds(std::chrono::steady_clock::time_point a,
                        std::chrono::steady_clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  // The decode of a run whose all-gather completed (on gloo's thread; see the file's comment).
  void decode(const at::Tensor& flat, const at::Tensor& tensor, int64_t seq,
              const std::string& header, int threads, std::chrono::steady_clock::time_point start,
              bool timed, double before_s) {
    const auto arrived = std::chrono::steady_clock::now();
    const int64_t rows = world_, P = messages_.size(1);
    at::Tensor columns = received_.view({world_, rows, P});
    bool foreign = false;
    for (int64_t r = 0; r < rows && !foreign; ++r) {
      const int64_t lo = std::min(r * m_, numel_), hi = std::min((r + 1) * m_, numel_);
      if (lo == hi) {
        continue;
      }
      at::Tensor messages = columns.select(1, r);
      if (api_->verify(messages, header, {r, r}, checksum_, step_, threads) < 0) {
        foreign = true;
        break;
      }
      at::Tensor target = flat.slice(0, lo, hi);
      if (dtype_ == at::kFloat && hi - lo == m_) {
        api_->decode_sum(messages, m_, bits_, group_size_, format_, threads, target);
      } else {
        api_->decode_sum(messages, m_, bits_, group_size_, format_, threads, scratch_);
        target.copy_(scratch_.slice(0, 0, hi - lo));
      }
    }
    if (foreign) {  // the Python plan decodes it all again, and raises what the call met
      py::gil_scoped_acquire acquire;
      py::object plan = plan_();
      if (plan.is_none()) {
        throw std::runtime_error("lowbitcc: a call met a foreign message after its plan was gone");
      }
      plan.attr("finish_received")(tensor, received_, seq);
    }
    const auto end = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mutex_);
    timings_.codec_s += seconds(arrived, end) + before_s;
    timings_.wire_s += seconds(start, arrived) - before_s;
    if (timed) {
      timings_.modelled_s.push_back(seconds(start, end));
    }
  }

  c10::intrusive_ptr<c10d::Backend> transport_;
  py::object plan_;  // a weak reference: the plan keeps its core
  py::object size_class_;
  at::Tensor messages_, nonfinite_, received_, scratch_;
  std::string header_;
  at::ScalarType dtype_;
  int64_t numel_, m_, world_, bits_, group_size_, format_, used_, step_, seq_offset_;
  double factor_, beta_;
  bool checksum_, modelled_;
  int64_t nbytes_, logical_bytes_, intra_bytes_, inter_bytes_;
  const std::vector<int64_t> shards_all_{0, 1};
  const lowbitcc_cpu::CodecApi* api_ = nullptr;
  std::mutex mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> last_;
  RunTimings timings_;
};

}  // namespace lowbitcc
