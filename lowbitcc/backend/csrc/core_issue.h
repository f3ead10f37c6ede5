// A plan core's run issued (plan_core.h's `PlanCore`: its members here are declared there): the
// run made and handed to its issuing thread (the issue lane, or the calling thread), its error
// states taken, its schedule's run, then the issuing thread's end of it (its states put back, its
// sent bytes counted); and the bytes of a transfer counted as it starts. Included by plan_core.h
// after the class.
#pragma once

#include "plan_core.h"

namespace lowbitcc {

// One run (plan_core.h's file comment): all-reduce `tensor` in place, or reduce-scatter it into
// `output`, as call number `seq`, its encodes' residual sums added into `sums` (the
// statistics' accumulator of the thread the Python path encodes on); `timed`: its wall time
// goes to the cost model; `key`: where feedback is on, the key its error states are taken
// under (`FeedbackSlots::take`) before its first encode, by the thread that encodes, and put
// back once its encodes are done (`put`), its verdict given when it is done; `counts`: where
// the bytes of the transfers it started go (each counted once started, as `MeteredTransport`
// counts them: a run that fails counts those it started), counted by the time its Work
// completes. `lane`: the group's issue lane (null: none, the inline issuer's group): a whole
// run (`runs_whole`) is queued there and the call returns at once, unless `synchronous` (the
// caller waits for the Work as soon as it has it: c10d's `asyncOp` false), where handing it
// over would only add the lane's two thread wakes to the call; a run that issues on the
// calling thread waits for the lane's runs first (issue_lane.h). Either way it waits, first,
// for the place's run before it (whose buffers it writes). Called with the GIL held; its Work.
inline c10::intrusive_ptr<c10d::Work> PlanCore::run(const at::Tensor& tensor,
                                                    const at::Tensor& output, int64_t seq,
                                                    at::Tensor sums, bool timed,
                                                    std::shared_ptr<ServedCounts> counts,
                                                    std::optional<FeedbackKey> key, IssueLane* lane,
                                                    bool synchronous) {
  TORCH_CHECK(key.has_value() == (feedback_ != nullptr),
              "lowbitcc: a plan core's run takes error states where it has feedback");
  // (its group was shut down: no run starts, on the lane or on the calling thread)
  TORCH_CHECK(lane == nullptr || !lane->was_shut_down(),
              "lowbitcc: this process group has been shut down");
  auto self = shared_from_this();
  auto run = std::make_shared<Run>(tensor, output, seq, at::get_num_threads(), timed,
                                   std::move(counts), std::move(key), feedback_ != nullptr);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    run->previous = std::move(last_);
    last_ = run->result;
  }
  auto work = c10::make_intrusive<PlannedWork>(
      run->result, scatter_ ? c10d::OpType::_REDUCE_SCATTER_BASE : c10d::OpType::ALLREDUCE);
  if (runs_whole() && lane != nullptr && !synchronous) {
    try {
      lane->submit([self, run, sums]() { self->issue(run, sums); });
    } catch (...) {  // (the group was shut down: the run ends before it began)
      run->failed(std::current_exception());
      end_encodes(*run);
      throw;
    }
    return work;
  }
  {
    py::gil_scoped_release release;
    if (lane != nullptr) {
      lane->wait_idle();  // (its transfers go after the lane's, on the same gloo group)
    }
    run->wait_previous();
  }
  issue(run, sums);
  return work;
}

// `run` on its issuing thread: the issue lane (without the GIL: a whole run), or the calling
// thread (the GIL held, the place's run before it waited for): the place's run before it
// waited for, its error states taken (with the GIL), its schedule's run (none where they could
// not be), then `end_encodes`.
inline void PlanCore::issue(const std::shared_ptr<Run>& run, const at::Tensor& sums) {
  const bool held = PyGILState_Check() != 0;
  if (!held) {
    run->wait_previous();
  }
  bool ok = true;
  if (run->key && !held && !python_running()) {
    run->failed(std::make_exception_ptr(
        std::runtime_error("lowbitcc: a compressed call's run began as the interpreter exited")));
    ok = false;
  } else if (run->key) {
    std::optional<py::gil_scoped_acquire> acquired;
    if (!held) {
      acquired.emplace();
    }
    ok = take_states(*run);
  }
  {
    std::optional<py::gil_scoped_release> released;
    if (held) {
      released.emplace();
    }
    run->start = std::chrono::steady_clock::now();
    if (ok && hier_) {
      run_hier(shared_from_this(), run, sums);
    } else if (ok && (ring_ || tree_)) {
      ring_ ? run_ring(*run, sums) : run_tree(*run, sums);
    } else if (ok && two_phase_) {
      run_two_phases(shared_from_this(), run, sums);
    } else if (ok) {
      run_pieces(shared_from_this(), run, sums);
    }
  }
  end_encodes(*run);
}

// `run`'s error states taken under its key (the GIL held); whether they were (else its
// error is the run's, which then starts no transfer).
inline bool PlanCore::take_states(Run& run) {
  if (!run.key) {
    return true;
  }
  try {
    feedback_->take(run.key->call, run.key->tracked, run.tensor, run.states);
    run.verdict = run.states.verdict;
    return true;
  } catch (...) {
    run.failed(std::current_exception());
    return false;
  }
}

// The issuing thread's end of `run`, every encode done and every transfer started: its token
// given back (the run's last to be decoded decides it: the store may wait for its verdict as
// the states go back), its error states put back (with the GIL: feedback_slots.h), its sent
// bytes counted; then its part of the run is done (`complete`).
inline void PlanCore::end_encodes(Run& run) {
  if (--run.left == 0) {
    decided(run);
  }
  if (run.taken != nullptr && run.verdict && python_running()) {
    py::gil_scoped_acquire acquire;
    try {
      feedback_->put(run.states);
    } catch (...) {  // (its verdict may be given already: the call raises this all the same)
      run.failed(std::current_exception());
    }
  }
  run.let_go_of_states();
  if (run.counts) {
    const SentBytes& sent = run.sent;
    run.counts->add(ServedCounts::kCompressed, ServedCounts::kWireBytes, sent.intra + sent.inter);
    run.counts->add(ServedCounts::kCompressed, ServedCounts::kIntraNodeBytes, sent.intra);
    run.counts->add(ServedCounts::kCompressed, ServedCounts::kInterNodeBytes, sent.inter);
  }
  if (--run.parts == 0) {
    complete(run);
  }
}

// A transfer of `run` started that sends `bytes` to transport rank `peer` (a send), or
// `row_bytes` to every other rank (an all-to-all's row, an all-gather's messages): its bytes
// in `run.sent`, to this node's ranks or others' (`MeteredTransport.send_async`, `_to_peers`).
inline void PlanCore::sent_to(Run& run, int64_t peer, int64_t bytes) const {
  (same_node_[peer] ? run.sent.intra : run.sent.inter) += bytes;
}

inline void PlanCore::sent_to_peers(Run& run, int64_t row_bytes) const {
  run.sent.intra += peers_inside_ * row_bytes;
  run.sent.inter += peers_across_ * row_bytes;
}

// Wait for every transfer a run started and has not waited for (its error the run's): none
// may still write or read the core's buffers once the run is done, nor be left for the next
// run's transfers of the same peer and tag to meet. (A gloo send or receive is waited for
// once: a second wait waits for a second message.)
inline void PlanCore::await_all(const std::vector<c10::intrusive_ptr<c10d::Work>>& started,
                                Run& run) {
  for (const auto& work : started) {
    try {
      if (!work->isCompleted()) {
        work->wait();
      }
    } catch (...) {
      run.failed(std::current_exception());
    }
  }
}

}  // namespace lowbitcc
