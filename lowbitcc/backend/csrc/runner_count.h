// What a served call counts and leaves (steady_runner.h's `SteadyRunner`: its members here are
// declared there): the schedule's index and the entry's runs, the call number, the feedback
// key's ordinal, the cost model's count and times, the statistics (in C++, served_counts.h), the
// logical bytes of an exact call, and the tagged Work of an exact one. Included by
// steady_runner.h after the class.
#pragma once

#include "steady_runner.h"

namespace lowbitcc {

// `CallSchedule.take` at a served call's place: the schedule's index, and `CallSchedule.ran`:
// the entry's runs, the renewal started where due (as `ran` itself; what it raises, the call
// raises, having taken its call number as `Reductions.take` does).
inline void SteadyRunner::ran(const Steady& steady) {
  schedule_.attr(LOWBITCC_NAME("_next")) = py::int_(steady.index + 1);
  if (!steady.renews) {
    steady.entry.attr(LOWBITCC_NAME("left")) = py::int_(steady.left - 1);
    return;
  }
  try {
    schedule_.attr(LOWBITCC_NAME("ran"))(steady.entry);
  } catch (py::error_already_set&) {
    agreement_.attr(LOWBITCC_NAME("next_seq"))();
    throw;
  }
}

// `policy.explicit_key`: the call counts in the innermost `feedback_key` block, if any; the
// key the block names for it (none: no block).
inline std::optional<std::string> SteadyRunner::count_in_key_block() {
  if (PyList_GET_SIZE(key_stack_.ptr()) == 0) {
    return std::nullopt;
  }
  detail::Held held(policy_lock_);
  const Py_ssize_t blocks = PyList_GET_SIZE(key_stack_.ptr());
  if (blocks == 0) {
    return std::nullopt;
  }
  py::list block = py::reinterpret_borrow<py::list>(PyList_GET_ITEM(key_stack_.ptr(), blocks - 1));
  const int64_t calls = block[1].cast<int64_t>();
  block[1] = py::int_(calls + 1);
  std::string name = block[0].cast<std::string>();
  return calls == 0 ? name : name + "#" + std::to_string(calls);
}

// `CostModel.count`: one more call of `size_class`.
inline void SteadyRunner::count_class(const py::object& model, const py::object& size_class) {
  detail::Held held(model.attr(LOWBITCC_NAME("_lock")));
  PyObject* found = detail::item(model.attr(LOWBITCC_NAME("_classes")), size_class);
  py::object kept = found != nullptr ? py::reinterpret_borrow<py::object>(found)
                                     : model.attr(LOWBITCC_NAME("_class"))(size_class);
  detail::add_to(kept, LOWBITCC_NAME("calls"), py::int_(1));
}

// The accumulator of the compressed calls' residual sums (`Stats.accumulator`) of the thread
// the Python path encodes on (the worker, else the calling thread), so that the sums add up
// in the same order on either path; asked again where `state.STATS` was replaced (`counted_in`).
// (The worker runs nothing meanwhile: its queue was idle, and the calling thread is the one
// that queues.)
inline at::Tensor SteadyRunner::accumulator() {
  py::object stats = counted_in();
  if (!stats.is(sums_of_)) {
    sums_ = stats.attr(LOWBITCC_NAME("accumulator"))(compressed_name_, cpu_device_,
                                                     encoder_thread_)
                .cast<at::Tensor>();
    sums_of_ = stats;
  }
  return sums_;
}

// `state.STATS`, read at each served call as the Python path reads it, which the served
// calls' counts (`counts_`) are folded into when it is read (`Stats.watch_counts`); where it
// was replaced, what was counted before is the statistics' it replaced, which watch them no
// more (`Stats.fold_counts`).
inline py::object SteadyRunner::counted_in() {
  py::object stats = state_.attr(LOWBITCC_NAME("STATS"));
  if (!stats.is(counted_in_)) {
    if (counted_in_) {
      counted_in_.attr(LOWBITCC_NAME("fold_counts"))(counts_object_);
    }
    stats.attr(LOWBITCC_NAME("watch_counts"))(counts_object_);
    counted_in_ = stats;
  }
  return stats;
}

// `exact._logical_bytes` of a call of `collective` on `nbytes` input bytes, kept per
// collective and size (a steady call counts the same size again).
inline int64_t SteadyRunner::logical_bytes(const py::str& collective, int64_t nbytes) {
  const bool scatter = collective.is(reduce_scatter_);
  auto& kept = scatter ? logical_scatter_ : logical_all_reduce_;
  auto found = kept.find(nbytes);
  if (found != kept.end()) {
    return found->second;
  }
  if (kept.size() >= kLogicalKept) {
    kept.clear();
  }
  const int64_t bytes = logical_bytes_(collective, nbytes, world_).cast<int64_t>();
  kept.emplace(nbytes, bytes);
  return bytes;
}

// What the Python path counts for the run (`CallSchedule.take`, `ran`;
// `Reductions._run_exact`; `count_planned`; `count_exact`; `WorkerIssuer._times_next`).
inline void SteadyRunner::count(const Steady& steady, const py::str& collective,
                                const at::Tensor& like, int64_t numel) {
  py::object model = compressed_.attr(LOWBITCC_NAME("cost_model"));
  timings_.fold(model, false);  // the runs timed before, in batches
  ran(steady);
  agreement_.attr(LOWBITCC_NAME("next_seq"))();
  if (steady.ordinal) {
    next_ordinal(collective, like, numel, steady.task);
  }
  int64_t nbytes = numel * static_cast<int64_t>(like.element_size());
  if (steady.modelled) {
    count_class(model, exact_class(collective, nbytes));
    if (issuer_counts_) {
      detail::add_to(issuer_, LOWBITCC_NAME("_issued"), py::int_(1));
    }
  }
  const int64_t sent = logical_bytes(collective, nbytes);
  counted_in();  // (`count_exact` reads `state.STATS` at each call)
  counts_->add(ServedCounts::kExact, ServedCounts::kCalls, 1);
  counts_->add(ServedCounts::kExact, ServedCounts::kTensorBytes, nbytes);
  counts_->add(ServedCounts::kExact, ServedCounts::kLogicalBytes, sent);
  counts_->add(ServedCounts::kExact, ServedCounts::kWireBytes, sent);
  counts_->add(ServedCounts::kExact, ServedCounts::kModelExact, steady.by_model ? 1 : 0);
  ++served_;
}

// `CompressedCalls._ordinal`: the position of a call of `collective` on `numel` elements of
// `like`'s dtype among the calls of that signature in the current epoch (`policy.epoch`: the
// backward pass `task`, or where none runs, -1, the optimizer step), counted.
inline int64_t SteadyRunner::next_ordinal(const py::str& collective, const at::Tensor& like,
                                          int64_t numel, int64_t task) {
  py::object dtype = py::reinterpret_borrow<py::object>(
      reinterpret_cast<PyObject*>(torch::getTHPDtype(like.scalar_type())));
  py::tuple epoch = task >= 0 ? py::tuple(py::make_tuple(backward_, task))
                              : py::tuple(py::make_tuple(step_, state_.attr(LOWBITCC_NAME("_optimizer_steps"))));
  detail::Held held(compressed_.attr(LOWBITCC_NAME("_lock")));
  if (!detail::equal(epoch, compressed_.attr(LOWBITCC_NAME("_epoch")))) {
    compressed_.attr(LOWBITCC_NAME("_epoch")) = epoch;
    compressed_.attr(LOWBITCC_NAME("_ordinals")).attr(LOWBITCC_NAME("clear"))();
  }
  py::dict ordinals = compressed_.attr(LOWBITCC_NAME("_ordinals"));
  py::tuple signature = py::make_tuple(collective, dtype, numel);
  int64_t ordinal = ordinals.contains(signature) ? ordinals[signature].cast<int64_t>() : 0;
  ordinals[signature] = py::int_(ordinal + 1);
  return ordinal;
}

// The cost model's size class of an exact call of `nbytes` input bytes
// (`CostModel.size_class`).
inline py::tuple SteadyRunner::exact_class(const py::str& collective, int64_t nbytes) const {
  int64_t log2 = 63 - __builtin_clzll(static_cast<uint64_t>(std::max<int64_t>(nbytes, 1)));
  return py::make_tuple(collective, device_name_, log2);
}

// A timed exact run (`Steady::timed`; `WorkerIssuer.native_now`): its gloo `work`, issued
// at `issued`, timed until it completes (`ModelTimings`).
inline void SteadyRunner::time_exact(const Steady& steady,
                                     const c10::intrusive_ptr<c10d::Work>& work,
                                     const py::str& collective, const at::Tensor& like,
                                     int64_t numel, std::chrono::steady_clock::time_point issued) {
  if (steady.timed) {
    const int64_t nbytes = numel * static_cast<int64_t>(like.element_size());
    timings_.start_exact(work, exact_class(collective, nbytes), nbytes, issued);
  }
}

// `IssueQueue.follow`: the call's tagged `FollowedWork` (its Python class) over gloo's `work`,
// which the runner keeps a while (`retired_`, as the Python path's waiter retires it), but a
// point-to-point call's.
inline py::object SteadyRunner::follow(const c10::intrusive_ptr<c10d::Work>& work,
                                       std::vector<at::Tensor> outputs, bool checked) {
  if (!FollowedWork::point_to_point(work->retrieveOpType())) {
    retired_.keep(work);
  }
  py::object issued = queue_.attr(LOWBITCC_NAME("_issued"));  // (`next(self._issued)`)
  py::object ordinal = py::reinterpret_steal<py::object>(PyIter_Next(issued.ptr()));
  if (!ordinal) {
    throw py::error_already_set();
  }
  uint64_t tag = queue_.attr(LOWBITCC_NAME("_group_tag")).cast<uint64_t>() |
                 (ordinal.cast<uint64_t>() & 0xFFFFFFFFull);
  py::object followed = followed_(work, std::move(outputs), tag, checked);
  followed.attr(LOWBITCC_NAME("queue")) = queue_;
  return followed;
}

}  // namespace lowbitcc
