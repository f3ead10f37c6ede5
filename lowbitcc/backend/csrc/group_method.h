// GroupMethod: one reduction method of a "loco" group (`allreduce`, `reduce_scatter_single`,
// `_reduce_scatter_base`, `reduce_scatter_single_coalesced`), or one of its data movements
// (`_allgather_base`, `allgather`, `broadcast`, `alltoall_base`) or point-to-point calls (`send`,
// `recv`, `recv_anysource`), as a C++ callable that
// lowbitcc/backend/steady_runner.py's `install`
// puts in the group's instance dict, where every caller finds it before the class's Python
// method: Python's (`dist.all_reduce` calls `group.allreduce`, `dist.reduce_scatter_tensor`
// `group._reduce_scatter_base`) and, for `allreduce` and `reduce_scatter_single_coalesced`,
// c10d's C++ callers (DDP's reducer, the functional all-reduce and reduce-scatter), whose call
// pybind's trampoline of the Python process group hands to the attribute it finds (a callable
// that is not a C function counts as the Python override; torch's trampoline has no
// `reduce_scatter_single` or `_reduce_scatter_base`, so a C++ caller of those reaches the
// group's inner gloo backend, as before these methods). A call is first
// offered to the group's runners (its `_runner`, CPU tensors', then its `_device_runner`, a
// CUDA group's CUDA tensors', read at each call, so that a test may swap in a `NoRunner`): a
// steady call is served there, and so runs no Python frame from c10d to the wire but at a
// place's renewal; any other call goes to `fallback`, the class's Python method
// (eager-wrapped: lowbitcc/backend/eager.py), with the group. Either runs with torch.compile's
// frame evaluation off (`set_eval_frame`, eager.py's `SET_EVAL_FRAME`), as the class's methods
// do: c10d may call the group from a compiled region's eager part.
//
// Only a callable object may take a method's place in the instance dict: pybind's trampoline
// takes a C function found there for "not overridden", and keeps that for the group's whole
// class (every "loco" group's calls from C++ would then go to the inner gloo backend, exact).
//
// The group is held weakly (the group holds its methods); a call after it is gone raises.
// Threads: called with the GIL, as any Python callable.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <stdexcept>
#include <utility>

#include "python_objects.h"
#include "steady_runner.h"

namespace lowbitcc {

// What the methods share: the group, the fallback, the runner read at each call, and frame
// evaluation turned off for a scope.
class __attribute__((visibility("hidden"))) GroupMethod {
 public:
  // `group`: a weak reference to the group; `fallback`: the class's Python method (called as
  // `fallback(group, *args)`); `runner_type`: the `SteadyRunner` class, whose instances serve;
  // `set_eval_frame`: torch.compile's (None: torch has none, nothing to turn off).
  GroupMethod(py::object group, py::object fallback, py::object runner_type,
              py::object set_eval_frame)
      : group_(std::move(group)),
        fallback_(std::move(fallback)),
        runner_type_(std::move(runner_type)),
        set_eval_frame_(std::move(set_eval_frame)) {}

 protected:
  // torch.compile's frame evaluation off for its life, the caller's callback restored after
  // (what raised too).
  class Eager {
   public:
    explicit Eager(const py::object& set_eval_frame) : set_(set_eval_frame) {
      if (!set_.is_none()) {
        prior_ = set_(py::none());
      }
    }
    ~Eager() {
      if (set_.is_none()) {
        return;
      }
      PyObject *type, *value, *traceback;
      PyErr_Fetch(&type, &value, &traceback);  // (a raised error kept across the restore)
      PyObject* done = PyObject_CallOneArg(set_.ptr(), prior_.ptr());
      if (done == nullptr) {
        PyErr_WriteUnraisable(set_.ptr());
      } else {
        Py_DECREF(done);
      }
      PyErr_Restore(type, value, traceback);
    }
    Eager(const Eager&) = delete;
    Eager& operator=(const Eager&) = delete;

   private:
    const py::object& set_;
    py::object prior_ = py::none();
  };

  py::object live_group() const {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject* group = nullptr;  // (a new reference; PyWeakref_GetObject is deprecated)
    if (PyWeakref_GetRef(group_.ptr(), &group) < 0) {
      throw py::error_already_set();
    }
    if (group == nullptr) {
      throw std::runtime_error("lowbitcc: a reduction method was called after its group was gone");
    }
    return py::reinterpret_steal<py::object>(group);
#else
    PyObject* group = PyWeakref_GetObject(group_.ptr());  // (borrowed)
    if (group == nullptr) {
      throw py::error_already_set();
    }
    if (group == Py_None) {
      throw std::runtime_error("lowbitcc: a reduction method was called after its group was gone");
    }
    return py::reinterpret_borrow<py::object>(group);
#endif
  }

  // The group's runner `name` where it is a `SteadyRunner` (the caller keeps the object while
  // it serves), else None (a `NoRunner`: the Python path).
  py::object runner_of(const py::object& group, py::handle name) const {
    py::object runner = group.attr(name);
    if (Py_TYPE(runner.ptr()) != reinterpret_cast<PyTypeObject*>(runner_type_.ptr())) {
      return py::none();
    }
    return runner;
  }

  // The call: `serve(runner)` by the group's CPU runner, then its device runner (each a
  // `SteadyRunner` serves only its device type's tensors; None: declined), else, and where both
  // decline, `fallback(group, args...)`; frame evaluation off throughout.
  template <typename Serve, typename... Args>
  py::object call(Serve&& serve, const Args&... args) {
    Eager eager(set_eval_frame_);
    py::object group = live_group();
    for (py::handle name : {LOWBITCC_NAME("_runner"), LOWBITCC_NAME("_device_runner")}) {
      py::object runner = runner_of(group, name);
      if (!runner.is_none()) {
        py::object served = serve(runner.cast<SteadyRunner&>());
        if (!served.is_none()) {
          return served;
        }
      }
    }
    return fallback_(group, args...);
  }

  py::object group_;
  py::object fallback_;
  py::object runner_type_;
  py::object set_eval_frame_;
};

// A method whose call the runners serve by `Serve` (their method of the same arguments, each a
// Python object as the caller passed it): the runner's Work, else the Python method's result.
template <auto Serve>
class ServedMethod;

template <typename... Handles, py::object (SteadyRunner::*Serve)(Handles...)>
class __attribute__((visibility("hidden"))) ServedMethod<Serve> : public GroupMethod {
 public:
  using GroupMethod::GroupMethod;

  py::object operator()(Handles... args) {
    return call([&](SteadyRunner& runner) { return (runner.*Serve)(args...); }, args...);
  }
};

// `group.allreduce(tensors, opts)`.
using AllReduceMethod = ServedMethod<&SteadyRunner::serve_all_reduce>;
// `group.reduce_scatter_single(output, input, opts)` (and `_reduce_scatter_base`).
using ReduceScatterMethod = ServedMethod<&SteadyRunner::serve_reduce_scatter>;
// The data movements (runner_moves.h): `group._allgather_base(output, input, opts)` (and
// `all_gather_single`, the class's name of it), `group.allgather(outputs, inputs, opts)`,
// `group.broadcast(tensors, opts)`, `group.alltoall_base(output, input, output_split_sizes,
// input_split_sizes, opts)` (and `all_to_all_single`).
using AllGatherBaseMethod = ServedMethod<&SteadyRunner::serve_all_gather_base>;
using AllGatherMethod = ServedMethod<&SteadyRunner::serve_all_gather>;
using BroadcastMethod = ServedMethod<&SteadyRunner::serve_broadcast>;
using AllToAllMethod = ServedMethod<&SteadyRunner::serve_all_to_all>;
// The point-to-point calls (runner_moves.h): `group.send(tensors, dst, tag)`,
// `group.recv(tensors, src, tag)`, `group.recv_anysource(tensors, tag)`.
using SendMethod = ServedMethod<&SteadyRunner::serve_send>;
using RecvMethod = ServedMethod<&SteadyRunner::serve_recv>;
using RecvAnysourceMethod = ServedMethod<&SteadyRunner::serve_recv_anysource>;

// `group.reduce_scatter_single_coalesced(outputs, inputs, opts)` (and the older
// `reduce_scatter_tensor_coalesced`), as c10d's C++ callers issue a reduce-scatter (the
// functional `reduce_scatter_tensor`, through pybind's trampoline): one output and one input are
// the runner's (the place `reduce_scatter_single` takes, which is this call of one tensor),
// several the Python method's.
class __attribute__((visibility("hidden"))) ReduceScatterCoalescedMethod : public GroupMethod {
 public:
  using GroupMethod::GroupMethod;

  py::object operator()(py::handle outputs, py::handle inputs, py::handle opts) {
    return call(
        [&](SteadyRunner& runner) -> py::object {
          if (!PyList_Check(outputs.ptr()) || !PyList_Check(inputs.ptr()) ||
              PyList_GET_SIZE(outputs.ptr()) != 1 || PyList_GET_SIZE(inputs.ptr()) != 1) {
            return py::none();
          }
          return runner.serve_reduce_scatter(PyList_GET_ITEM(outputs.ptr(), 0),
                                             PyList_GET_ITEM(inputs.ptr(), 0), opts);
        },
        outputs, inputs, opts);
  }
};

}  // namespace lowbitcc
