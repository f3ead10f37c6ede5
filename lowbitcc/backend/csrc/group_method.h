// GroupMethod: one reduction method of a "loco" group (`allreduce`, `reduce_scatter_single`,
// `_reduce_scatter_base`) as a C++ callable that lowbitcc/backend/steady_runner.py's `install`
// puts in the group's instance dict, where every caller finds it before the class's Python
// method: Python's (`dist.all_reduce` calls `group.allreduce`) and c10d's C++ callers (DDP's
// reducer, functional collectives), whose call pybind's trampoline of the Python process group
// hands to the attribute it finds (a callable that is not a C function counts as the Python
// override). A call is first offered to the group's runner (its `_runner`, read at each call, so
// that a test may swap in a `NoRunner`): a steady call is served there, and so runs no Python
// frame from c10d to the wire; any other call goes to `fallback`, the class's Python method
// (eager-wrapped: lowbitcc/backend/eager.py), with the group.
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

// What both methods share: the group, the fallback, and the runner read at each call.
class __attribute__((visibility("hidden"))) GroupMethod {
 public:
  // `group`: a weak reference to the group; `fallback`: the class's Python method (called as
  // `fallback(group, *args)`); `runner_type`: the `SteadyRunner` class, whose instances serve.
  GroupMethod(py::object group, py::object fallback, py::object runner_type)
      : group_(std::move(group)),
        fallback_(std::move(fallback)),
        runner_type_(std::move(runner_type)) {}

 protected:
  py::object live_group() const {
    PyObject* group = PyWeakref_GetObject(group_.ptr());  // (borrowed)
    if (group == nullptr) {
      throw py::error_already_set();
    }
    if (group == Py_None) {
      throw std::runtime_error("lowbitcc: a reduction method was called after its group was gone");
    }
    return py::reinterpret_borrow<py::object>(group);
  }

  // The group's runner where it is a `SteadyRunner` (the caller keeps the object while it
  // serves), else None (a `NoRunner`: the Python path).
  py::object runner_of(const py::object& group) const {
    py::object runner = group.attr(LOWBITCC_NAME("_runner"));
    if (Py_TYPE(runner.ptr()) != reinterpret_cast<PyTypeObject*>(runner_type_.ptr())) {
      return py::none();
    }
    return runner;
  }

  py::object group_;
  py::object fallback_;
  py::object runner_type_;
};

// `group.allreduce(tensors, opts)`: the runner's Work, else the Python method's result.
class __attribute__((visibility("hidden"))) AllReduceMethod : public GroupMethod {
 public:
  using GroupMethod::GroupMethod;

  py::object operator()(py::handle tensors, py::handle opts) {
    py::object group = live_group();
    py::object runner = runner_of(group);
    if (!runner.is_none()) {
      py::object served = runner.cast<SteadyRunner&>().serve_all_reduce(tensors, opts);
      if (!served.is_none()) {
        return served;
      }
    }
    return fallback_(group, tensors, opts);
  }
};

// `group.reduce_scatter_single(output, input, opts)` (and `_reduce_scatter_base`): as above.
class __attribute__((visibility("hidden"))) ReduceScatterMethod : public GroupMethod {
 public:
  using GroupMethod::GroupMethod;

  py::object operator()(py::handle output, py::handle input, py::handle opts) {
    py::object group = live_group();
    py::object runner = runner_of(group);
    if (!runner.is_none()) {
      py::object served = runner.cast<SteadyRunner&>().serve_reduce_scatter(output, input, opts);
      if (!served.is_none()) {
        return served;
      }
    }
    return fallback_(group, output, input, opts);
  }
};

}  // namespace lowbitcc
