// A device runner's steady call (steady_runner.h's `SteadyRunner`, made by
// lowbitcc/backend/steady_runner.py's `device_runner`: a CUDA group's, over its inner
// ProcessGroupNCCL; its members here are declared there). It takes the place of a dense tensor
// of its device type issued by any thread but a future's callback, while the group's watchdog
// has not ended it, where the call is the place's steady entry, as `CallSchedule.take` does.
//
// A compressed entry's run is then the Python path's (`serve_run`): `Reductions.run` with the
// arguments `LocoProcessGroup`'s method would give it (on CUDA `CudaIssuer.run_plan` on the
// call's stream, whose plan replays its host record in C++ where it keeps one, launch_replay.h:
// the direct schedule's plans of one chunk, not their first runs).
//
// An exact entry it serves whole (`serve_own`): what `Reductions._run_exact` and
// `CudaIssuer.native_now` do, in the same order. The call is
// counted (`count`, as the CPU runner's exact entry: the schedule's index and the entry's runs,
// the call number, the ordinal, the cost model's count, the statistics; no issuer count and no
// tag, which a CUDA call has not), the inner backend's call is issued with the caller's options
// on the calling thread (with its current device and stream, which NCCL reads) with the GIL
// released, and the inner backend's Work is the call's, as `CudaIssuer` returns it (where it
// returned none, having run the call synchronously, c10d's `asyncOp` false: the issuer's
// `CudaIssuer.synced`, a `StreamWork` on the current stream, or during a graph capture a
// `ready_work`, as `CudaIssuer.native` makes). The group's watchdog is asked again once the
// call is counted, as `CudaIssuer.native` asks it (`Watchdog.check`: the call raises the error
// that ended the group). The place is claimed with no Python run between its last look and its
// claim (`still_at`): a device runner's callers may be several threads, and Python code run
// from C++ may hand the GIL to another of them (a canary's `nan` waits without it). An
// all-reduce keeps `CudaIssuer.canary` of its output and Work at the place (`Entry.keep`: a
// `DeviceCanary`, a pinned copy of the last element made on the Work's future; None during a
// graph capture), read by the place's run two periods later (`nan`). Included by
// steady_runner.h after the class.
#pragma once

#include <stdexcept>

#include "steady_runner.h"

namespace lowbitcc {

template <typename Issue>
inline py::object SteadyRunner::serve_own(const Steady& steady, const py::str& collective,
                                          const at::Tensor& like, py::handle output,
                                          py::handle canary_of, Issue&& issue) {
  if (!still_at(steady)) {  // another thread took the place meanwhile: the Python path's
    return py::none();
  }
  count(steady, collective, like, like.numel());
  if (!watchdog_.is_none()) {
    watchdog_.attr(LOWBITCC_NAME("check"))();
  }
  c10::intrusive_ptr<c10d::Work> work;
  {
    py::gil_scoped_release release;
    work = issue();
  }
  py::object handed;
  if (work) {
    handed = py::cast(work);
  } else if (!synced_.is_none()) {
    py::list outputs;  // (`[output]`, as `CudaIssuer.native` passes it)
    outputs.append(output);
    handed = synced_(outputs);
  } else {  // (counted: the call was issued, as on every rank)
    throw std::runtime_error("lowbitcc: the inner backend returned no Work for a " +
                             collective.cast<std::string>() + " at its place's exact entry");
  }
  if (!canary_of.is_none()) {  // `Entry.keep(issuer.canary(output, work))`
    py::object canary = canary_(canary_of, handed);
    steady.entry.attr(LOWBITCC_NAME("canary")) = steady.entry.attr(LOWBITCC_NAME("latest"));
    steady.entry.attr(LOWBITCC_NAME("latest")) = canary;
  }
  return handed;
}

inline py::object SteadyRunner::serve_run(const Steady& steady, const py::str& collective,
                                          int64_t numel, py::handle tensor, py::handle output,
                                          const py::object& op, const py::object& native) {
  if (!still_at(steady)) {  // another thread took the place meanwhile: the Python path's
    return py::none();
  }
  ran(steady);
  ++served_;
  ++served_compressed_;
  return reductions_.attr(LOWBITCC_NAME("run"))(steady.entry, collective, tensor, output,
                                                 py::int_(numel), op, native);
}

// Whether the schedule is still at the place `steady_place` found (its index next, the entry's
// runs as read), read with nothing run since that could let another thread take it first.
inline bool SteadyRunner::still_at(const Steady& steady) {
  return schedule_.attr(LOWBITCC_NAME("_next")).cast<int64_t>() == steady.index &&
         steady.entry.attr(LOWBITCC_NAME("left")).cast<int64_t>() == steady.left;
}

}  // namespace lowbitcc
