// ModelTimings: the cost model's timings of the runs the steady runner serves, handed to the
// cost model in batches (`CostModel.record_all`, one Python call per `kBatch` timings):
//   - an exact run the worker issuer would time (one in `EXACT_TIMED`,
//     lowbitcc/backend/worker_issue.py, as `WorkerIssuer.native_now` times it in Python): its
//     wall time from just before it is issued until gloo completes it, taken on the thread gloo
//     completes it on, which touches no Python object;
//   - a plan core's run the cost model times (its `RunTimings::modelled_s`).
// A timing reaches the cost model at a later call of the runner, once `kBatch` are finished
// (`SteadyRunner.fold_timings` hands over every finished one at once): the cost model decides
// at a place's renewals, a period of runs ahead, so a few runs' delay changes nothing it does.
//
// Threads: every method is called with the GIL held (the runner's caller); an exact timing's
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

class ModelTimings {
 public:
  static constexpr size_t kBatch = 8;  // finished timings handed over in one call

  // Time `work`, issued at `issued`, an exact call of the cost model's `size_class` and
  // `nbytes` input bytes. A work without a future (gloo's flat reduce-scatter) is not timed, as
  // in Python.
  void start_exact(const c10::intrusive_ptr<c10d::Work>& work, py::object size_class,
                   int64_t nbytes, std::chrono::steady_clock::time_point issued) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = work->getFuture();
    } catch (const std::exception&) {  // "Work::getFuture not implemented"
      return;
    }
    auto seconds = std::make_shared<std::atomic<double>>(-1.0);
    timings_.push_back(Timing{std::move(size_class), true, nbytes, seconds});
    future->addCallback([seconds, issued](c10::ivalue::Future&) {  // (also where it failed)
      seconds->store(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - issued).count());
    });
  }

  // A finished run's time on the path `exact` (a plan core's: compressed).
  void add(py::object size_class, bool exact, double seconds, int64_t nbytes) {
    timings_.push_back(Timing{std::move(size_class), exact, nbytes,
                              std::make_shared<std::atomic<double>>(seconds)});
  }

  // Hand the finished timings to `model` (the group's `CostModel.record_all`), in the order
  // the runs were served, once `kBatch` are finished, or `all` of them; the unfinished stay.
  void fold(const py::object& model, bool all) {
    size_t finished = 0;
    for (const Timing& timing : timings_) {
      finished += timing.seconds->load() >= 0.0;
    }
    if (finished == 0 || (!all && finished < kBatch)) {
      return;
    }
    std::vector<Timing> left;
    py::list done;
    for (Timing& timing : timings_) {
      const double seconds = timing.seconds->load();
      if (seconds < 0.0) {
        left.push_back(std::move(timing));
      } else {
        done.append(py::make_tuple(timing.size_class, timing.exact, seconds, timing.nbytes));
      }
    }
    timings_ = std::move(left);
    model.attr("record_all")(done);
  }

 private:
  struct Timing {
    py::object size_class;
    bool exact;
    int64_t nbytes;
    std::shared_ptr<std::atomic<double>> seconds;  // -1 until the run completes
  };
  std::vector<Timing> timings_;
};

}  // namespace lowbitcc
