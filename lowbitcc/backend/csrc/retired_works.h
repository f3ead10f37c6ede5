// RetiredWorks: the gloo Works of the calls a CPU runner served (steady_runner.h's `follow`:
// exact entries and data movements), kept referenced by the runner for a while, as
// lowbitcc/transports/gloo.py's `GlooTransport.retire` keeps the Python path's.
//
// A gloo worker thread lets go of its reference to a Work just after marking it done. Where that
// reference is the last one (the caller has already let go of the call's Work), the gloo thread
// frees the Work's tensors, which takes the GIL for a tensor that had a Python object; while the
// interpreter finalizes, that kills the thread inside a destructor and the process aborts
// ("terminate called without an active exception", as plain gloo does at exit). Kept here, the
// gloo thread's release is not the last: the runner lets go of a Work on the calling thread, with
// the GIL, once it was issued more than `retain_s` seconds before and is not among the last
// `retain_last` kept. (gloo.py keeps a Work for `retain_s` after it is done; a served call's end
// is not seen by the runner, and some of gloo's Works never read as done, its reduce-scatter's,
// so the time is counted from the issue: a call still running after `retain_s` is held by its
// gloo thread and by its caller, who waits for it.) A point-to-point call's Work is not kept: no
// gloo thread holds it (its wait is the caller's).
//
// Threads: `keep` is called with the GIL held (the runner's serving thread), which serializes its
// callers.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <utility>

namespace lowbitcc {

class RetiredWorks {
 public:
  using Clock = std::chrono::steady_clock;

  RetiredWorks(double retain_s, int64_t retain_last)
      : retain_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(retain_s))),
        retain_last_(static_cast<size_t>(retain_last)) {}

  // Keep `work` (a served call's, just issued); let go of those issued more than `retain_s`
  // before, beyond the last `retain_last`.
  void keep(c10::intrusive_ptr<c10d::Work> work) {
    const Clock::time_point now = Clock::now();
    while (kept_.size() > retain_last_ && now - kept_.front().issued > retain_) {
      kept_.pop_front();
    }
    kept_.push_back({std::move(work), now});
  }

  // How many Works it keeps now.
  size_t size() const { return kept_.size(); }

 private:
  struct Kept {
    c10::intrusive_ptr<c10d::Work> work;
    Clock::time_point issued;  // when `keep` kept it
  };

  Clock::duration retain_;
  size_t retain_last_;
  std::deque<Kept> kept_;  // oldest first
};

}  // namespace lowbitcc
