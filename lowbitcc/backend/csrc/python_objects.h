// Helpers of the C++ code that reads and writes lowbitcc's own Python objects, with the GIL held
// (the steady runner's schedule, statistics and cost model; a plan core's feedback store): a
// number attribute added to, a dict's item, Python equality, and a Python `threading.Lock` held
// for a scope.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <utility>

namespace lowbitcc {
namespace detail {

// `obj.name += delta` for a Python number attribute.
inline void add_to(py::handle obj, const char* name, py::handle delta) {
  py::object now = obj.attr(name);
  py::object sum = py::reinterpret_steal<py::object>(PyNumber_Add(now.ptr(), delta.ptr()));
  if (!sum) {
    throw py::error_already_set();
  }
  obj.attr(name) = sum;
}

// `mapping[key]` of a dict (or a dict subclass, such as an OrderedDict: a read), borrowed;
// nullptr where the key is not there; what a key's hash or comparison raised, thrown.
inline PyObject* item(py::handle mapping, py::handle key) {
  PyObject* found = PyDict_GetItemWithError(mapping.ptr(), key.ptr());
  if (found == nullptr && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  return found;
}

// `a == b` in Python.
inline bool equal(py::handle a, py::handle b) {
  int result = PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_EQ);
  if (result < 0) {
    throw py::error_already_set();
  }
  return result == 1;
}

// Holds a Python `threading.Lock` for a scope (its acquire waits without the GIL). The GIL is
// held by the caller throughout.
class Held {
 public:
  explicit Held(py::object lock) : lock_(std::move(lock)) { lock_.attr("acquire")(); }
  ~Held() {
    try {
      lock_.attr("release")();
    } catch (...) {
    }
  }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;

 private:
  py::object lock_;
};

}  // namespace detail
}  // namespace lowbitcc
