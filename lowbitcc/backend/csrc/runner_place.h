// Whether a call runs as its place's entry now (steady_runner.h's `SteadyRunner`: its members
// here are declared there): the schedule's entry at the call's index read as `CallSchedule.take`
// reads it, the place's renewal taken where it is due, the policy's blocks, the entry's key and
// canary, and, for a compressed entry, its plan's C++ core and the worker's queue (a device
// runner's compressed entry: none of those two, its run being `Reductions.run`'s). Included by
// steady_runner.h after the class.
#pragma once

#include "steady_runner.h"

namespace lowbitcc {

// Whether the call runs as its place's entry now (steady_runner.h's file comment), fills
// `steady`.
// Nothing is changed, but where the place's renewal is due to be taken at this run: it is
// taken as `CallSchedule.take` takes it (the Python path then finds it taken).
inline bool SteadyRunner::steady_place(const py::str& collective, const at::Tensor& like,
                                       int64_t numel, c10d::ReduceOp::RedOpType op,
                                       Steady& steady) {
  try {
    return steady_place_or_raise(collective, like, numel, op, steady);
  } catch (Raised& raised) {
    throw raised.error;
  } catch (py::error_already_set&) {  // nothing changed: the Python path raises as it does
    return false;
  } catch (const std::exception&) {
    return false;
  }
}

// (`waited`: the worker's queue was waited for once already; `renewed`: the place's renewal
// was taken by this call.)
inline bool SteadyRunner::steady_place_or_raise(const py::str& collective, const at::Tensor& like,
                                                int64_t numel, c10d::ReduceOp::RedOpType op,
                                                Steady& steady, bool waited, bool renewed) {
  if (!serves_this_thread()) {
    return false;
  }
  if (py::cast<int64_t>(schedule_.attr(LOWBITCC_NAME("_open"))) != 0) {
    return false;
  }
  py::object period_obj = schedule_.attr(LOWBITCC_NAME("_period"));
  if (period_obj.is_none()) {
    return false;
  }
  int64_t period = period_obj.cast<int64_t>();
  if (period <= 0) {
    return false;
  }
  int64_t origin = schedule_.attr(LOWBITCC_NAME("_origin")).cast<int64_t>();
  int64_t index = schedule_.attr(LOWBITCC_NAME("_next")).cast<int64_t>();
  int64_t offset = (index - origin) % period;
  if (offset < 0) {
    offset += period;
  }
  py::object entries = schedule_.attr(LOWBITCC_NAME("_entries"));
  PyObject* found = detail::item(entries, py::int_(origin + offset));
  if (found == nullptr) {
    return false;
  }
  py::object entry = py::reinterpret_borrow<py::object>(found);
  const bool exact = entry.attr(LOWBITCC_NAME("exact")).cast<bool>();
  if (exact ? native_ops_.count(static_cast<int64_t>(op)) == 0 || entry.attr(LOWBITCC_NAME("timed")).cast<bool>()
            : op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::AVG) {
    return false;
  }
  int64_t left = entry.attr(LOWBITCC_NAME("left")).cast<int64_t>();
  if (left <= 0) {  // the run after the entry's last takes its renewal (`CallSchedule.entry`)
    if (renewed || entry.attr(LOWBITCC_NAME("renewal")).is_none() || nan(entry.attr(LOWBITCC_NAME("canary")))) {
      return false;
    }
    take_renewal(index);
    return steady_place_or_raise(collective, like, numel, op, steady, waited, true);
  }
  if (nan(entry.attr(LOWBITCC_NAME("canary")))) {  // (may wait without the GIL: the policy is read after)
    return false;
  }
  // `explicit_key` names an exact call's key and counts it in its block: the Python path's
  // (a compressed call counts in it, and with feedback its states are the key's:
  // `serve_planned`, or a device runner's `Reductions.run`)
  if (exact && PyList_GET_SIZE(key_stack_.ptr()) != 0) {
    return false;
  }
  Py_ssize_t modes = PyList_GET_SIZE(mode_stack_.ptr());
  std::string mode =
      modes ? py::cast<std::string>(PyList_GET_ITEM(mode_stack_.ptr(), modes - 1)) : policy_;
  // `Reductions._wish`: "exact" and an entry compressed, or "compressed" (the cost model's
  // consent too) and an entry exact, is a deviation
  if (mode == (exact ? "always" : "never")) {
    return false;
  }
  // `CallSchedule.ran` starts the place's renewal at this run
  steady.renews = left - 1 <= schedule_.attr(LOWBITCC_NAME("_renew_at")).cast<int64_t>() &&
                  entry.attr(LOWBITCC_NAME("renewal")).is_none() && !schedule_.attr(LOWBITCC_NAME("_renew")).is_none() &&
                  !entry.attr(LOWBITCC_NAME("desc")).attr(LOWBITCC_NAME("part")).cast<bool>();
  py::tuple key = entry.attr(LOWBITCC_NAME("key"));
  if (key.size() != 6 || !detail::equal(key[0], collective) ||
      key[1].ptr() != reinterpret_cast<PyObject*>(torch::getTHPDtype(like.scalar_type())) ||
      key[2].cast<int64_t>() != static_cast<int64_t>(op) || key[3].cast<int64_t>() != numel ||
      key[4].cast<bool>() || py::bool_(key[5])) {  // (a parent's tag: 64 bits, unsigned)
    return false;  // a deviation: the Python path runs it
  }
  if (!exact && own_work_) {  // a device runner's compressed entry: `Reductions.run` runs it
    if (declines_at_random()) {
      return false;
    }
    steady.python_run = true;
    steady.entry = std::move(entry);
    steady.index = index;
    steady.left = left;
    return true;
  }
  if (!exact) {
    return planned_place(std::move(entry), collective, like, op, index, left,
                         modes != 0 && mode == "always", waited, steady);
  }
  // `CompressedCalls.count_planned`: the ordinal where this rank would compress the call
  // (`policy.wants_compression`), counted in the backward pass's epoch (`policy.epoch`)
  int64_t task = torch::autograd::get_current_graph_task_id();
  bool wants = mode == "auto" || (mode != "never" && task >= 0);
  steady.ordinal = entry.attr(LOWBITCC_NAME("eligible")).cast<bool>() && policy_ != "never" && wants;
  if (steady.ordinal && task < 0) {
    return false;  // the step's epoch: `policy.epoch` reads the optimizer's steps
  }
  steady.task = task;
  steady.modelled = compressed_.attr(LOWBITCC_NAME("_modelling")).cast<bool>() && numel >= min_size_;
  // `WorkerIssuer.native_now` times this one for the cost model: so does the runner
  steady.timed = steady.modelled && issuer_counts_ && timed_every_ > 0 &&
                 (issuer_.attr(LOWBITCC_NAME("_issued")).cast<int64_t>() + 1) % timed_every_ == 0;
  if (declines_at_random()) {
    return false;
  }
  steady.by_model = steady.modelled && entry.attr(LOWBITCC_NAME("by_model")).cast<bool>();
  steady.entry = std::move(entry);
  steady.index = index;
  steady.left = left;
  return true;
}

// The rest of `steady_place` for a compressed entry: whether its plan's core serves the
// call (`forced`: a `compressed()` block is the innermost, `policy.forced`).
inline bool SteadyRunner::planned_place(py::object entry, const py::str& collective,
                                        const at::Tensor& like, c10d::ReduceOp::RedOpType op,
                                        int64_t index, int64_t left, bool forced, bool waited,
                                        Steady& steady) {
  py::object plan = entry.attr(LOWBITCC_NAME("plan"));
  if (plan.is_none()) {
    return false;
  }
  if (!plan.attr(LOWBITCC_NAME("core_checked")).cast<bool>()) {
    plan_core_(plan);  // sets the plan's `core` (None: the Python plan runs it)
  }
  py::object core = plan.attr(LOWBITCC_NAME("core"));
  if (core.is_none()) {
    return false;
  }
  auto planned = core.cast<std::shared_ptr<PlanCore>>();
  if (!planned->fits(like, steady.output) ||
      (planned->feedback() != nullptr && !named_in_utf8())) {
    return false;
  }
  if (queue_.attr(LOWBITCC_NAME("_pending")).cast<int64_t>() != 0) {
    if (waited) {
      return false;
    }
    // the worker's queued calls on the same gloo group go first: once they have run (the
    // GIL released meanwhile), the place is looked at again
    queue_.attr(LOWBITCC_NAME("wait_idle"))();
    return steady_place_or_raise(collective, like, like.numel(), op, steady, true);
  }
  if (declines_at_random()) {
    return false;
  }
  steady.modelled = planned->modelled() && !forced;  // `Reductions._plan_run`'s `timed`
  steady.core = std::move(planned);
  steady.entry = std::move(entry);
  steady.index = index;
  steady.left = left;
  return true;
}

// `CallSchedule.entry` at `index`, which the run after an entry's last calls to take its
// renewal, called as `CallSchedule.take` calls it: the index moved on first (what it raises,
// the call raises, as `CallSchedule.take` and `Reductions.take` do: having counted its place,
// or where a peer's deviation report made the schedule forget what it learned, with the index
// `forget` left, and having taken its call number); where it returns, the index is put back,
// and the place is looked at again.
inline void SteadyRunner::take_renewal(int64_t index) {
  schedule_.attr(LOWBITCC_NAME("_next")) = py::int_(index + 1);
  try {
    schedule_.attr(LOWBITCC_NAME("entry"))(index);
  } catch (py::error_already_set& error) {
    agreement_.attr(LOWBITCC_NAME("next_seq"))();
    throw Raised{std::move(error)};
  }
  schedule_.attr(LOWBITCC_NAME("_next")) = py::int_(index);
}

// The place's canary: whether the output it views ended in NaN (`Entry.canary`, None: no).
inline bool SteadyRunner::nan(const py::object& canary) {
  if (canary.is_none()) {
    return false;
  }
  if (py::isinstance<FollowedWork>(canary)) {
    FollowedWork& work = canary.cast<FollowedWork&>();
    if (work.isCompleted()) {  // the steady state: its run after next reads it
      return work.nan();
    }
    py::gil_scoped_release release;
    return work.nan();
  }
  return canary.attr(LOWBITCC_NAME("nan"))().cast<bool>();
}

}  // namespace lowbitcc
