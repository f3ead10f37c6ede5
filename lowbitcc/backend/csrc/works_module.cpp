// lowbitcc's C++ Works and steady calls (lowbitcc/backend/native.py): the module's Python
// bindings. `FollowedWork` is followed_work.h's, `RunVerdict` feedback_slots.h's, `PlanCore`
// plan_core.h's, `ServedCounts` served_counts.h's, `SteadyRunner` steady_runner.h's,
// `AllReduceMethod`, `ReduceScatterMethod`, `ReduceScatterCoalescedMethod`, `AllGatherBaseMethod`,
// `AllGatherMethod`, `BroadcastMethod`, `AllToAllMethod`, `SendMethod`, `RecvMethod` and
// `RecvAnysourceMethod` group_method.h's,
// `IssueLane` issue_lane.h's, `LaunchReplay` launch_replay.h's.
#include "followed_work.h"
#include "group_method.h"
#include "issue_lane.h"
#include "launch_replay.h"
#include "plan_core.h"
#include "steady_runner.h"

namespace {

// One of group_method.h's classes, bound with the constructor they share (its `__call__` is
// each one's own).
template <typename Method>
py::class_<Method> group_method(py::module& m, const char* name) {
  return py::class_<Method>(m, name).def(
      py::init<py::object, py::object, py::object, py::object>(), py::arg("group"),
      py::arg("fallback"), py::arg("runner_type"), py::arg("set_eval_frame"));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lowbitcc's C++ Works and steady calls (lowbitcc/backend/native.py)";
  m.def(
      "set_deviation",
      [](int64_t probe, std::string message, py::object error_type) {
        lowbitcc::Deviation& kept = lowbitcc::deviation();
        if (kept.error_type == nullptr) {
          kept.error_type = error_type.release().ptr();  // kept for the process
          kept.message = std::move(message);
          kept.probe = probe;
        }
      },
      py::arg("probe"), py::arg("message"), py::arg("error_type"),
      "deviated_output.py's PROBE and MESSAGE, and the class a deviated call raises (set once).");
  py::register_exception_translator([](std::exception_ptr raised) {
    try {
      if (raised) {
        std::rethrow_exception(raised);
      }
    } catch (const lowbitcc::DeviatedCallError& error) {
      PyObject* type = lowbitcc::deviation().error_type;
      PyErr_SetString(type != nullptr ? type : PyExc_RuntimeError, error.what());
    }
  });
  py::class_<lowbitcc::FollowedWork, c10d::Work, c10::intrusive_ptr<lowbitcc::FollowedWork>>(
      m, "FollowedWork", py::dynamic_attr())
      .def(py::init<c10::intrusive_ptr<c10d::Work>, std::vector<at::Tensor>, uint64_t, bool>(),
           py::arg("inner"), py::arg("outputs"), py::arg("tag"), py::arg("checked") = true)
      .def("nan", &lowbitcc::FollowedWork::nan, py::call_guard<py::gil_scoped_release>(),
           "Whether the call's output ends in NaN (its place's canary); waits for the call.")
      .def_property_readonly("tag", &lowbitcc::FollowedWork::tag)
      .def_property_readonly("checked", &lowbitcc::FollowedWork::checked)
      .def_property_readonly("inner", &lowbitcc::FollowedWork::inner)
      .def_property_readonly("outputs", &lowbitcc::FollowedWork::outputs);
  py::class_<lowbitcc::RunVerdict, std::shared_ptr<lowbitcc::RunVerdict>>(m, "RunVerdict")
      .def("dropped", &lowbitcc::RunVerdict::dropped, py::call_guard<py::gil_scoped_release>(),
           "Whether the states the run stored count as dropped; waits until the run is done.")
      .def("done", &lowbitcc::RunVerdict::done);
  py::class_<lowbitcc::PlanCore, std::shared_ptr<lowbitcc::PlanCore>>(m, "PlanCore")
      .def(py::init<py::object, py::dict, py::capsule, py::object>(), py::arg("transport"),
           py::arg("spec"), py::arg("api"), py::arg("park"))
      .def("wait", &lowbitcc::PlanCore::wait, py::call_guard<py::gil_scoped_release>(),
           "Wait until the place's last C++ run is done.")
      .def("take_seconds", &lowbitcc::PlanCore::take_seconds,
           "The codec and wire seconds its runs measured since the last take (counters.Stats).");
  py::class_<lowbitcc::IssueLane, std::shared_ptr<lowbitcc::IssueLane>>(m, "IssueLane")
      .def(py::init<>())
      .def("wait_idle", &lowbitcc::IssueLane::wait_idle,
           "Wait until every run queued on the lane so far has run to its end (the GIL let go).")
      .def("close", &lowbitcc::IssueLane::close, py::arg("timeout_s"),
           "Take no more runs; wait up to `timeout_s` seconds (negative: without bound) for those "
           "queued, then end the lane's thread or leave it to end by itself; whether all had run.")
      .def("shut_down", &lowbitcc::IssueLane::shut_down,
           "Mark its group shut down: no run of the group starts any more (then `close` it).")
      .def_property_readonly("idle", &lowbitcc::IssueLane::idle)
      .def_property_readonly("submitted", &lowbitcc::IssueLane::submitted,
                             "How many runs have been queued on the lane since it was made.");
  py::class_<lowbitcc::ServedCounts, std::shared_ptr<lowbitcc::ServedCounts>>(m, "ServedCounts")
      .def_static("names", &lowbitcc::ServedCounts::names,
                  "Every field's name (counters.Counters' names), the counts' then the seconds'.")
      .def("take_counts", &lowbitcc::ServedCounts::take_counts,
           "What the runner's calls counted since the last take, by category and field, zeroed "
           "(counters.Stats.watch_counts).");
  py::class_<lowbitcc::SteadyRunner>(m, "SteadyRunner")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>, py::dict>(), py::arg("direct"),
           py::arg("objects"))
      .def("serve_all_reduce", &lowbitcc::SteadyRunner::serve_all_reduce, py::arg("tensors"),
           py::arg("opts"))
      .def("serve_reduce_scatter", &lowbitcc::SteadyRunner::serve_reduce_scatter,
           py::arg("output"), py::arg("input"), py::arg("opts"))
      .def("decline_at_random", &lowbitcc::SteadyRunner::decline_at_random, py::arg("p"),
           py::arg("seed"))
      .def("fold_timings", &lowbitcc::SteadyRunner::fold_timings,
           "Hand every finished timing of the runs it served to the cost model now (served "
           "calls hand them over 8 at a time).")
      .def_property_readonly("served", &lowbitcc::SteadyRunner::served)
      .def_property_readonly("served_compressed", &lowbitcc::SteadyRunner::served_compressed)
      .def_property_readonly("served_moves", &lowbitcc::SteadyRunner::served_moves)
      .def_property_readonly("kept_works", &lowbitcc::SteadyRunner::kept_works,
                             "How many gloo Works of the calls it served it keeps now "
                             "(retired_works.h).")
      .def_property_readonly("counts", &lowbitcc::SteadyRunner::counts);
  group_method<lowbitcc::AllReduceMethod>(m, "AllReduceMethod")
      .def("__call__", &lowbitcc::AllReduceMethod::operator(), py::arg("tensors"),
           py::arg("opts") = py::none(),
           "The group's `allreduce`: a steady call served by its runner, else the Python method.");
  group_method<lowbitcc::ReduceScatterMethod>(m, "ReduceScatterMethod")
      .def("__call__", &lowbitcc::ReduceScatterMethod::operator(), py::arg("output"),
           py::arg("input"), py::arg("opts") = py::none(),
           "The group's `reduce_scatter_single`: as `AllReduceMethod`.");
  group_method<lowbitcc::ReduceScatterCoalescedMethod>(m, "ReduceScatterCoalescedMethod")
      .def("__call__", &lowbitcc::ReduceScatterCoalescedMethod::operator(), py::arg("outputs"),
           py::arg("inputs"), py::arg("opts") = py::none(),
           "The group's `reduce_scatter_single_coalesced`: one tensor as `ReduceScatterMethod`.");
  group_method<lowbitcc::AllGatherBaseMethod>(m, "AllGatherBaseMethod")
      .def("__call__", &lowbitcc::AllGatherBaseMethod::operator(), py::arg("output"),
           py::arg("input"), py::arg("opts") = py::none(),
           "The group's `_allgather_base`: a data movement served by its runner, else the Python "
           "method.");
  group_method<lowbitcc::AllGatherMethod>(m, "AllGatherMethod")
      .def("__call__", &lowbitcc::AllGatherMethod::operator(), py::arg("output_tensors"),
           py::arg("input_tensors"), py::arg("opts") = py::none(),
           "The group's `allgather`: as `AllGatherBaseMethod`.");
  group_method<lowbitcc::BroadcastMethod>(m, "BroadcastMethod")
      .def("__call__", &lowbitcc::BroadcastMethod::operator(), py::arg("tensors"),
           py::arg("opts") = py::none(), "The group's `broadcast`: as `AllGatherBaseMethod`.");
  group_method<lowbitcc::AllToAllMethod>(m, "AllToAllMethod")
      .def("__call__", &lowbitcc::AllToAllMethod::operator(), py::arg("output"), py::arg("input"),
           py::arg("output_split_sizes"), py::arg("input_split_sizes"),
           py::arg("opts") = py::none(), "The group's `alltoall_base`: as `AllGatherBaseMethod`.");
  group_method<lowbitcc::SendMethod>(m, "SendMethod")
      .def("__call__", &lowbitcc::SendMethod::operator(), py::arg("tensors"), py::arg("dst"),
           py::arg("tag") = 0, "The group's `send`: as `AllGatherBaseMethod`.");
  group_method<lowbitcc::RecvMethod>(m, "RecvMethod")
      .def("__call__", &lowbitcc::RecvMethod::operator(), py::arg("tensors"), py::arg("src"),
           py::arg("tag") = 0, "The group's `recv`: as `AllGatherBaseMethod`.");
  group_method<lowbitcc::RecvAnysourceMethod>(m, "RecvAnysourceMethod")
      .def("__call__", &lowbitcc::RecvAnysourceMethod::operator(), py::arg("tensors"),
           py::arg("tag") = 0, "The group's `recv_anysource`: as `AllGatherBaseMethod`.");
  py::class_<lowbitcc::LaunchReplay, std::shared_ptr<lowbitcc::LaunchReplay>>(m, "LaunchReplay")
      .def(py::init<int64_t, py::object>(), py::arg("device"), py::arg("recorder"))
      .def("add_kernel", &lowbitcc::LaunchReplay::add_kernel, py::arg("function"),
           py::arg("grid_x"), py::arg("grid_y"), py::arg("block"), py::arg("args"))
      .def("add_transfer", &lowbitcc::LaunchReplay::add_transfer, py::arg("backend"),
           py::arg("all_to_all"), py::arg("recv"), py::arg("send"))
      .def("add_call", &lowbitcc::LaunchReplay::add_call, py::arg("call"))
      .def("replay", &lowbitcc::LaunchReplay::replay, py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "Issue every step in order on `stream`; the seconds its transfers took to issue.")
      .def("__len__", &lowbitcc::LaunchReplay::size)
      .def_property_readonly("native_steps", &lowbitcc::LaunchReplay::native_steps);
}
