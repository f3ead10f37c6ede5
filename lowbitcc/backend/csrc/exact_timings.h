// ExactTimings: the cost model's timings of the exact calls the steady runner serves, one in
// `EXACT_TIMED` on the worker issuer (lowbitcc/backend/worker_issue.py), as
// `WorkerIssuer.native_now` times them in Python: each call's wall time from just before it is
// issued until gloo completes it. The time is taken on the thread gloo completes the call on,
// which touches no Python object; the runner hands the finished timings to the cost model
// (`CostModel.record(size_class, True, seconds, nbytes)`) with the GIL, at its next call.
//
// Threads: `start` and `fold` are called with the GIL held (the runner's caller); a timing's
// end is written by gloo's thread through its own shared cell.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace lowbitcc {

class ExactTimings {
 public:
  // Time `work`, issued at `issued`, a call of the cost model's `size_class` and `nbytes` input
  // bytes. A work without a future (gloo's flat reduce-scatter) is not timed, as in Python.
  void start(const c10::intrusive_ptr<c10d::Work>& work, py::object size_class, int64_t nbytes,
             std::chrono::steady_clock::time_point issued) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = work->getFuture();
    } catch (const std::exception&) {  // "Work::getFuture not implemented"
      return;
    }
    auto seconds = std::make_shared<std::atomic<double>>(-1.0);
    timings_.push_back(Timing{std::move(size_class), nbytes, seconds});
    future->addCallback([seconds, issued](c10::ivalue::Future&) {  // (also where it failed)
      seconds->store(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - issued).count());
    });
  }

  // Hand every finished timing to `model` (the group's `CostModel`), in the order the calls
  // were issued; the unfinished ones stay.
  void fold(const py::object& model) {
    if (timings_.empty()) {
      return;
    }
    std::vector<Timing> left, done;
    for (Timing& timing : timings_) {
      (timing.seconds->load() < 0.0 ? left : done).push_back(std::move(timing));
    }
    timings_ = std::move(left);
    for (const Timing& timing : done) {
      model.attr("record")(timing.size_class, true, timing.seconds->load(), timing.nbytes);
    }
  }

 private:
  struct Timing {
    py::object size_class;
    int64_t nbytes;
    std::shared_ptr<std::atomic<double>> seconds;  // -1 until the call completes
  };
  std::vector<Timing> timings_;
};

}  // namespace lowbitcc
