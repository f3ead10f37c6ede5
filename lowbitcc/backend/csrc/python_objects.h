// Helpers of the C++ code that reads and writes lowbitcc's own Python objects, with the GIL held
// (the steady runner's schedule, statistics and cost model; a plan core's feedback store): an
// attribute's name interned once, a number attribute added to, a dict's item, Python equality,
// and a Python `threading.Lock` held for a scope.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <utility>

// `LOWBITCC_NAME("text")`: the Python str "text", interned, made once per place it is written
// (with the GIL, at its first use) and kept for the process. `obj.attr(LOWBITCC_NAME("x"))`
// looks "x" up by a str whose hash is known and which the attribute dicts hold itself, where
// pybind's `obj.attr("x")` makes and hashes a new str at every lookup (the steady runner reads
// and writes some thirty attributes per call).
#define LOWBITCC_NAME(text)                                            \
  ([]() -> py::handle {                                                \
    static PyObject* const interned = PyUnicode_InternFromString(text); \
    return interned;                                                   \
  }())

namespace lowbitcc {
namespace detail {

// `obj.name += delta` for a Python number attribute (`name`: a `LOWBITCC_NAME`).
inline void add_to(py::handle obj, py::handle name, py::handle delta) {
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
  explicit Held(py::object lock) : lock_(std::move(lock)) {
    PyObject* done = PyObject_CallMethodNoArgs(lock_.ptr(), LOWBITCC_NAME("acquire").ptr());
    if (done == nullptr) {
      throw py::error_already_set();
    }
    Py_DECREF(done);
  }
  ~Held() {
    PyObject* done = PyObject_CallMethodNoArgs(lock_.ptr(), LOWBITCC_NAME("release").ptr());
    if (done == nullptr) {
      PyErr_Clear();
    } else {
      Py_DECREF(done);
    }
  }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;

 private:
  py::object lock_;
};

}  // namespace detail
}  // namespace lowbitcc
