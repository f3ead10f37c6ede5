// PointCompleter: the thread that waits for a CPU runner's served point-to-point calls (a gloo
// send, receive or receive from any source: runner_moves.h), in the order they were served, as
// the group's waiter waits for the Python path's (lowbitcc/backend/issue_queue.py).
//
// gloo completes a send or a receive only inside its Work's `wait`, and the Work owns the
// transfer's buffer: a send whose Work nobody waits for and everybody lets go of is never
// written. So each served point-to-point call's `FollowedWork` is handed here at once (`add`):
// the completer holds it and waits for it (`FollowedWork::settle`: the call's one wait of gloo's
// Work, without a bound of its own), after which it reads as complete (`isCompleted`), as a queued call's
// Work does once the waiter has seen its message; a caller's own `wait` waits for that same one
// wait (or, where the completer has not reached the call yet and the caller waits without a
// bound, is it). The calls are waited for in the order they were served, as the waiter waits for
// queued ones: a receive whose message is late holds back the completion of those after it (not
// their transfers), and gloo ends its wait at the group's timeout. A Work it has waited for is
// not let go of on its thread (whose release could be the last, freeing tensors with the GIL at
// the interpreter's exit): it is handed back to the runner's serving thread (`take_done`), which
// lets go of it with the GIL, as does the destructor (the runner's, with the GIL); those it waits
// for after that it never lets go of (a group's last calls, kept until the process ends).
//
// The thread is started by the first `add` and ends once the runner is gone (`close`) and every
// call handed to it has been waited for; it holds only this object's shared state.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "followed_work.h"

namespace lowbitcc {

class PointCompleter {
 public:
  PointCompleter() = default;
  PointCompleter(const PointCompleter&) = delete;
  PointCompleter& operator=(const PointCompleter&) = delete;
  // Called with the GIL held (the runner's destructor): the Works waited for are let go of here.
  ~PointCompleter() {
    close();
    take_done();
  }

  // Hand `work` (a served point-to-point call's) to the completer, starting its thread first
  // where none runs. Called with the GIL held.
  void add(c10::intrusive_ptr<FollowedWork> work) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->waiting.push_back(std::move(work));
    if (!started_) {
      std::thread(run, state_).detach();
      started_ = true;
    }
    state_->changed.notify_one();
  }

  // The Works it has waited for since the last take (the caller lets go of them, with the GIL).
  std::vector<c10::intrusive_ptr<FollowedWork>> take_done() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return std::exchange(state_->done, {});
  }

  // No more Works: the thread ends once those handed to it are waited for.
  void close() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->closed = true;
    state_->changed.notify_one();
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    std::deque<c10::intrusive_ptr<FollowedWork>> waiting;  // in the order served
    std::vector<c10::intrusive_ptr<FollowedWork>> done;  // waited for, not yet taken
    bool closed = false;
  };

  static void run(std::shared_ptr<State> state) {
    std::unique_lock<std::mutex> lock(state->mutex);
    while (true) {
      state->changed.wait(lock, [&] { return state->closed || !state->waiting.empty(); });
      if (state->waiting.empty()) {  // (closed, nothing left)
        for (auto& work : state->done) {  // (waited for since the runner's end: never let go of)
          work.release();
        }
        return;
      }
      c10::intrusive_ptr<FollowedWork> work = state->waiting.front();
      lock.unlock();
      work->settle();
      lock.lock();
      state->waiting.pop_front();
      state->done.push_back(std::move(work));
    }
  }

  std::shared_ptr<State> state_ = std::make_shared<State>();
  bool started_ = false;  // (under `state_->mutex`)
};

}  // namespace lowbitcc
