// A group's exact data movements served in C++ (steady_runner.h's `SteadyRunner`: its members
// here are declared there): an all-gather into one tensor (`_allgather_base`, as
// `dist.all_gather_into_tensor` issues it: FSDP's parameter gathers), an all-gather into a list
// (`allgather`, `dist.all_gather`), a broadcast (`broadcast`, `dist.broadcast`: DDP's buffers)
// and an all-to-all (`alltoall_base`, `dist.all_to_all_single`: a mixture of experts' tokens),
// each of one tensor, and the point-to-point calls (`send`, `recv`, `recv_anysource`: pipeline
// stages' activations), as `data_movement.DataMovements.exact` runs them: counted in the
// statistics (one exact call, the bytes of its first argument: the outputs; `ServedCounts`),
// then the inner backend's own call with the caller's options, the GIL released.
//
// The CPU runner issues it on the group's inner gloo group (`inner_`, the one the worker issues
// the group's calls and compressed transfers on) from the calling thread, where the worker
// would issue it at once: nothing queued on the worker (`IssueQueue._pending`) or its issue lane
// (issue_lane.h), so the call keeps its issue order on every rank; and not where the group
// exchanges a descriptor before each data movement (`CompressedCalls.checks_data_movement`,
// `moves_checked_`; a point-to-point call exchanges none) or an all-gather may travel as
// `param_bits` codes (`param_bits_`). Its Work is the `FollowedWork` of the gloo call (tagged as
// the worker's Work; its value the outputs, flattened), not read for a deviation; a
// point-to-point call's is waited for once (followed_work.h), by the runner's completer
// (point_completer.h) as the Python path's waiter waits for a queued one.
// A device runner issues it on the inner NCCL group, as
// `CudaIssuer.native` does: the group's watchdog asked once it is counted, NCCL's Work handed
// back (none: `synced_`'s, of the outputs); its CPU test bed (steady_runner.py's
// `device_runner`) on the group's inner gloo group, where the worker is idle, as the CPU runner.
//
// Served only where neither backend can refuse the arguments, at issue or when the call runs (where
// either would, the Python path takes the call and the error reaches its Work, as before; what a
// backend raises at issue for another reason, a connection lost, a served call raises at once):
// plain dense tensors of the runner's device type, on one device, contiguous, of one dtype gloo
// moves (`moved_dtype`), sizes that match the group's (an output of `world_` inputs; an
// all-to-all's splits, `splits_fit`), the exact options types, a root rank of the group, a peer
// rank of the group other than this rank's and a tag of a non-negative C int (a receive from any
// source: CPU tensors, which NCCL cannot receive); a call from the main thread (CPU; a device
// runner: any thread) outside any future's callback, while the group is open and its watchdog has
// not ended it. Anything else is "not mine" (None) with nothing changed. Included by
// steady_runner.h after the class.
#pragma once

#include <ATen/core/Tensor.h>

#include <climits>
#include <cstdint>
#include <utility>
#include <vector>

#include "steady_runner.h"

namespace lowbitcc {

inline py::object SteadyRunner::serve_all_gather_base(py::handle output_obj, py::handle input_obj,
                                                      py::handle opts) {
  c10d::AllgatherOptions options;
  if (!options_of(opts, allgather_options_type_, options) || !moved(output_obj) ||
      !moved(input_obj) || (param_bits_ != 0 && device_type_ == c10::DeviceType::CPU)) {
    return py::none();
  }
  at::Tensor output = THPVariable_Unpack(output_obj.ptr());
  at::Tensor input = THPVariable_Unpack(input_obj.ptr());
  // (gloo cuts the output into `world_` pieces along its first dimension, each of the input's
  // shape: a stacked output, or a 0-d input, it refuses; NCCL takes any of the right size,
  // which the Python path then runs)
  if (output.scalar_type() != input.scalar_type() || output.device() != input.device() ||
      input.dim() == 0 || output.dim() != input.dim() || output.size(0) != input.size(0) * world_ ||
      output.sizes().slice(1) != input.sizes().slice(1) || !moves_here()) {
    return py::none();
  }
  return serve_move({output}, output,
                    [&] { return inner_->_allgather_base(output, input, options); });
}

inline py::object SteadyRunner::serve_all_gather(py::handle outputs_obj, py::handle inputs_obj,
                                                 py::handle opts) {
  c10d::AllgatherOptions options;
  if (!options_of(opts, allgather_options_type_, options) || !PyList_Check(inputs_obj.ptr()) ||
      PyList_GET_SIZE(inputs_obj.ptr()) != 1 || !PyList_Check(outputs_obj.ptr()) ||
      PyList_GET_SIZE(outputs_obj.ptr()) != 1) {
    return py::none();
  }
  py::handle input_obj = PyList_GET_ITEM(inputs_obj.ptr(), 0);
  py::handle list = PyList_GET_ITEM(outputs_obj.ptr(), 0);
  if (!moved(input_obj) || !PyList_Check(list.ptr()) || PyList_GET_SIZE(list.ptr()) != world_) {
    return py::none();
  }
  at::Tensor input = THPVariable_Unpack(input_obj.ptr());
  std::vector<at::Tensor> outputs;
  outputs.reserve(world_);
  for (Py_ssize_t i = 0; i < world_; ++i) {
    py::handle item = PyList_GET_ITEM(list.ptr(), i);
    if (!moved(item)) {
      return py::none();
    }
    const at::Tensor& out = THPVariable_Unpack(item.ptr());
    if (out.scalar_type() != input.scalar_type() || out.device() != input.device() ||
        out.sizes() != input.sizes()) {
      return py::none();
    }
    outputs.push_back(out);
  }
  if (!moves_here()) {
    return py::none();
  }
  at::Tensor counted = outputs[0];  // (every output the input's size: `world_` of them)
  std::vector<std::vector<at::Tensor>> lists{outputs};
  std::vector<at::Tensor> inputs{input};
  return serve_move(outputs, counted, [&] { return inner_->allgather(lists, inputs, options); },
                    world_);
}

inline py::object SteadyRunner::serve_broadcast(py::handle tensors_obj, py::handle opts) {
  c10d::BroadcastOptions options;
  if (!options_of(opts, broadcast_options_type_, options) || !PyList_Check(tensors_obj.ptr()) ||
      PyList_GET_SIZE(tensors_obj.ptr()) != 1 || options.rootTensor != 0 ||
      options.rootRank < 0 || options.rootRank >= world_) {
    return py::none();
  }
  py::handle item = PyList_GET_ITEM(tensors_obj.ptr(), 0);
  if (!moved(item) || !moves_here()) {
    return py::none();
  }
  std::vector<at::Tensor> tensors{THPVariable_Unpack(item.ptr())};
  return serve_move(tensors, tensors[0], [&] { return inner_->broadcast(tensors, options); });
}

inline py::object SteadyRunner::serve_all_to_all(py::handle output_obj, py::handle input_obj,
                                                 py::handle output_splits, py::handle input_splits,
                                                 py::handle opts) {
  c10d::AllToAllOptions options;
  if (!options_of(opts, alltoall_options_type_, options) || !moved(output_obj) ||
      !moved(input_obj)) {
    return py::none();
  }
  at::Tensor output = THPVariable_Unpack(output_obj.ptr());
  at::Tensor input = THPVariable_Unpack(input_obj.ptr());
  std::vector<int64_t> out_splits, in_splits;
  if (output.scalar_type() != input.scalar_type() || output.device() != input.device() ||
      output.dim() == 0 || input.dim() == 0 ||
      output.sizes().slice(1) != input.sizes().slice(1) ||
      !splits_fit(output_splits, output, out_splits) ||
      !splits_fit(input_splits, input, in_splits) ||
      (out_splits.empty() && in_splits.empty() && output.numel() != input.numel()) ||
      !moves_here()) {
    return py::none();
  }
  return serve_move({output}, output, [&] {
    return inner_->alltoall_base(output, input, out_splits, in_splits, options);
  });
}

inline py::object SteadyRunner::serve_send(py::handle tensors, py::handle dst, py::handle tag) {
  return serve_point(Point::kSend, tensors, dst, tag);
}

inline py::object SteadyRunner::serve_recv(py::handle tensors, py::handle src, py::handle tag) {
  return serve_point(Point::kRecv, tensors, src, tag);
}

inline py::object SteadyRunner::serve_recv_anysource(py::handle tensors, py::handle tag) {
  return serve_point(Point::kRecvAnysource, tensors, py::none(), tag);
}

// A point-to-point call of `kind`: `tensors` a list of one tensor, `peer` the other rank (None: a
// receive from any source), `tag` the call's tag (Python ints).
inline py::object SteadyRunner::serve_point(Point kind, py::handle tensors_obj, py::handle peer_obj,
                                            py::handle tag_obj) {
  if (!PyList_Check(tensors_obj.ptr()) || PyList_GET_SIZE(tensors_obj.ptr()) != 1 ||
      !PyLong_CheckExact(tag_obj.ptr()) ||
      (kind == Point::kRecvAnysource ? device_type_ != c10::DeviceType::CPU
                                     : !PyLong_CheckExact(peer_obj.ptr()))) {
    return py::none();
  }
  int overflow = 0;
  const long long tag = PyLong_AsLongLongAndOverflow(tag_obj.ptr(), &overflow);
  if (overflow != 0 || tag < 0 || tag > INT_MAX) {  // (gloo refuses a negative tag at issue)
    return py::none();
  }
  long long peer = -1;
  if (kind != Point::kRecvAnysource) {
    peer = PyLong_AsLongLongAndOverflow(peer_obj.ptr(), &overflow);
    if (overflow != 0 || peer < 0 || peer >= world_ || peer == inner_->getRank()) {
      return py::none();
    }
  }
  py::handle item = PyList_GET_ITEM(tensors_obj.ptr(), 0);
  if (!moved(item) || !moves_here(false)) {
    return py::none();
  }
  std::vector<at::Tensor> tensors{THPVariable_Unpack(item.ptr())};
  py::object handed = serve_move(tensors, tensors[0], [&] {
    switch (kind) {
      case Point::kSend:
        return inner_->send(tensors, static_cast<int>(peer), static_cast<int>(tag));
      case Point::kRecv:
        return inner_->recv(tensors, static_cast<int>(peer), static_cast<int>(tag));
      default:
        return inner_->recvAnysource(tensors, static_cast<int>(tag));
    }
  });
  if (!own_work_) {  // (the completer holds and waits for it; those it has waited for let go of)
    if (!points_) {
      points_ = std::make_unique<PointCompleter>();
    }
    points_->add(handed.cast<c10::intrusive_ptr<FollowedWork>>());
    points_->take_done();
  }
  return handed;
}

// Whether `splits` (an all-to-all's split sizes: a list of ints) fit `tensor` as c10d's
// `checkSplitSizes` checks them (NCCL at issue, gloo when the call runs): none, and its first
// dimension a multiple of the group's ranks; or one per rank summing to its first dimension,
// none negative (which neither checks, and which would make the transfers' lengths wrong).
// Fills `sizes`.
inline bool SteadyRunner::splits_fit(py::handle splits, const at::Tensor& tensor,
                                     std::vector<int64_t>& sizes) const {
  if (!PyList_Check(splits.ptr())) {
    return false;
  }
  const Py_ssize_t n = PyList_GET_SIZE(splits.ptr());
  if (n == 0) {
    return tensor.size(0) % world_ == 0;
  }
  if (n != world_) {
    return false;
  }
  sizes.reserve(n);
  int64_t sum = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(splits.ptr(), i);
    if (!PyLong_CheckExact(item)) {
      return false;
    }
    int overflow = 0;
    const long long size = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0 || size < 0 || size > tensor.size(0) - sum) {  // (the sum bounded: no wrap)
      return false;
    }
    sizes.push_back(size);
    sum += size;
  }
  return sum == tensor.size(0);
}

// A tensor a served data movement moves: plain, dense, of the runner's device type (as
// `plain_on_device`), contiguous, of a dtype gloo moves.
inline bool SteadyRunner::moved(py::handle obj) const {
  if (!plain_on_device(obj)) {
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(obj.ptr());
  return t.is_contiguous() && moved_dtype(t.scalar_type());
}

// The dtypes ProcessGroupGloo's data movements take (its `GENERATE_ALL_TYPES`).
inline bool SteadyRunner::moved_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kBool:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// Whether a data movement whose arguments serve is the runner's now (the file's comment): the
// calling thread, the group and its watchdog, the worker's queue and lane, the test switch
// (`described`: a call the group describes under `check_all`, which the Python path takes then).
inline bool SteadyRunner::moves_here(bool described) {
  if (!serves_this_thread()) {
    return false;
  }
  if (!queue_.is_none()) {  // the worker issues the Python path's (`DataMovements.exact`)
    if ((described && moves_checked_) || py::bool_(queue_.attr(LOWBITCC_NAME("_closed"))) ||
        queue_.attr(LOWBITCC_NAME("_pending")).cast<int64_t>() != 0 ||
        (lane_ && !lane_->idle())) {
      return false;
    }
  }
  return !declines_at_random();
}

// A data movement the runner serves: counted (`DataMovements.exact`: one exact call, the bytes of
// `counted`, `copies` times), `issue` (the inner backend's call) run with the GIL released, its
// Work: a `FollowedWork` of `outputs` (CPU), the inner backend's own (a device runner; none:
// `synced_`'s, of `outputs`).
template <typename Issue>
inline py::object SteadyRunner::serve_move(const std::vector<at::Tensor>& outputs,
                                           const at::Tensor& counted, Issue&& issue,
                                           int64_t copies) {
  counted_in();  // (`DataMovements.exact` reads `state.STATS` at each call)
  counts_->add(ServedCounts::kExact, ServedCounts::kCalls, 1);
  counts_->add(ServedCounts::kExact, ServedCounts::kTensorBytes,
               copies * counted.numel() * static_cast<int64_t>(counted.element_size()));
  ++served_;
  ++served_moves_;
  if (!watchdog_.is_none()) {  // (`CudaIssuer.native`)
    watchdog_.attr(LOWBITCC_NAME("check"))();
  }
  c10::intrusive_ptr<c10d::Work> work;
  {
    py::gil_scoped_release release;
    work = issue();
  }
  if (!own_work_) {
    return follow(work, outputs, false);
  }
  if (work) {
    return py::cast(work);
  }
  if (synced_.is_none()) {  // (counted: the call was issued, as on every rank)
    throw std::runtime_error(
        "lowbitcc: the inner backend returned no Work for a data movement it ran");
  }
  return synced_(py::cast(outputs));
}

}  // namespace lowbitcc
