// The host check of a cached device-digest table, compiled (host_native.py builds and loads
// it). Why: the check reads every listed tensor's address, byte length, dtype and layout at
// every call; torch's Python methods cost ~60-100 ns a tensor for the address alone (4,500
// reads per step for capture's three calls: ~0.42 ms on an H100 host), this loop ~8 ns for all
// of it. It decides exactly what hashing_triton._python_check decides in Python (members,
// local tensors, address, byte length, dtype, layout, lazy conj/neg bits): a 1 here means the
// table still describes the tensors.
//
// check(tensors, members, seen_members, ptrs, nbytes, dtypes, unwrap, seen_locs, contiguous)
//   tensors       list: the rows of this call (None: a row left out)
//   members       list or None: the objects the table was looked up by (the list itself, or the
//                 gradients' owners), compared by identity with seen_members
//   ptrs, nbytes  bytes: int64 per row, the address and byte length recorded (0 address: a row
//                 left out, which must still be None)
//   dtypes        list: the dtype object recorded per row (None for a row left out)
//   unwrap        0: rows are tensors; 1: every row has _local_tensor (a DTensor); 2: row by row
//   seen_locs     list or None: the local tensor objects recorded, compared by identity
//   contiguous    True: every row must be contiguous (gradients: new tensors each step)
// returns 0 when the members differ (another list under the same key), 1 when the table still
// describes the tensors, 2 when it does not (the caller builds it again). Never raises for a
// row it cannot read (that row answers 2).
#include <Python.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>

static PyObject* g_local_name = nullptr;  // "_local_tensor", interned

static int row_ok(PyObject* loc, Py_ssize_t i, int64_t ptr, int64_t nbytes, PyObject* dtype,
                  PyObject* seen_locs, bool contiguous) {
  if (seen_locs != Py_None && PyList_GET_ITEM(seen_locs, i) != loc) return 0;
  if (!THPVariable_Check(loc)) return 0;
  try {
    const at::Tensor& t = THPVariable_Unpack(loc);
    if (!t.defined() || !t.has_storage()) return 0;
    if (t.is_conj() || t.is_neg()) return 0;
    if (reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())) != dtype) return 0;
    if (static_cast<int64_t>(t.nbytes()) != nbytes) return 0;
    if (reinterpret_cast<int64_t>(t.const_data_ptr()) != ptr) return 0;
    if (contiguous && !t.is_contiguous()) return 0;
  } catch (...) {  // a tensor without readable storage (a wrapper subclass): not ours to hash
    PyErr_Clear();
    return 0;
  }
  return 1;
}

static PyObject* check(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "check() takes 9 arguments");
    return nullptr;
  }
  PyObject* tensors = args[0];
  PyObject* members = args[1];
  PyObject* seen_members = args[2];
  PyObject* ptrs_b = args[3];
  PyObject* nbytes_b = args[4];
  PyObject* dtypes = args[5];
  long unwrap = PyLong_AsLong(args[6]);
  PyObject* seen_locs = args[7];
  int contiguous = PyObject_IsTrue(args[8]);
  if (unwrap == -1 && PyErr_Occurred()) return nullptr;
  if (contiguous < 0) return nullptr;
  if (!PyList_CheckExact(tensors) || !PyList_CheckExact(dtypes) || !PyBytes_CheckExact(ptrs_b) ||
      !PyBytes_CheckExact(nbytes_b) || (members != Py_None && !PyList_CheckExact(members)) ||
      (members != Py_None && !PyList_CheckExact(seen_members)) ||
      (seen_locs != Py_None && !PyList_CheckExact(seen_locs))) {
    PyErr_SetString(PyExc_TypeError, "check(): lists and bytes expected");
    return nullptr;
  }
  if (members != Py_None) {
    Py_ssize_t m = PyList_GET_SIZE(members);
    if (PyList_GET_SIZE(seen_members) != m) return PyLong_FromLong(0);
    for (Py_ssize_t i = 0; i < m; ++i) {
      if (PyList_GET_ITEM(members, i) != PyList_GET_ITEM(seen_members, i)) {
        return PyLong_FromLong(0);
      }
    }
  }
  Py_ssize_t n = PyList_GET_SIZE(tensors);
  if (PyBytes_GET_SIZE(ptrs_b) != n * 8 || PyBytes_GET_SIZE(nbytes_b) != n * 8 ||
      PyList_GET_SIZE(dtypes) != n || (seen_locs != Py_None && PyList_GET_SIZE(seen_locs) != n)) {
    return PyLong_FromLong(2);
  }
  const char* ptrs = PyBytes_AS_STRING(ptrs_b);
  const char* sizes = PyBytes_AS_STRING(nbytes_b);
  for (Py_ssize_t i = 0; i < n; ++i) {
    // (a row's __getattr__ runs Python, which could shrink the lists: read within bounds only)
    if (i >= PyList_GET_SIZE(tensors) || i >= PyList_GET_SIZE(dtypes) ||
        (seen_locs != Py_None && i >= PyList_GET_SIZE(seen_locs))) {
      return PyLong_FromLong(2);
    }
    int64_t ptr, nbytes;
    std::memcpy(&ptr, ptrs + 8 * i, 8);
    std::memcpy(&nbytes, sizes + 8 * i, 8);
    PyObject* row = PyList_GET_ITEM(tensors, i);
    if (ptr == 0) {  // a row left out when the table was built: still left out
      if (row != Py_None) return PyLong_FromLong(2);
      continue;
    }
    if (row == Py_None) return PyLong_FromLong(2);
    PyObject* owned = nullptr;
    PyObject* loc = row;
    if (unwrap != 0) {
      owned = PyObject_GetAttr(row, g_local_name);
      if (owned == nullptr) {
        bool plain = unwrap == 2 && PyErr_ExceptionMatches(PyExc_AttributeError);
        PyErr_Clear();
        if (!plain) return PyLong_FromLong(2);
      } else {
        loc = owned;
      }
    }
    int ok = row_ok(loc, i, ptr, nbytes, PyList_GET_ITEM(dtypes, i), seen_locs, contiguous != 0);
    Py_XDECREF(owned);
    if (!ok) return PyLong_FromLong(2);
  }
  return PyLong_FromLong(1);
}

static PyMethodDef methods[] = {
    {"check", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(check)),
     METH_FASTCALL, "check(tensors, members, seen_members, ptrs, nbytes, dtypes, unwrap, "
                    "seen_locs, contiguous) -> 0 | 1 | 2 (see host_native.cpp)"},
    {nullptr, nullptr, 0, nullptr}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "parity_host_native", nullptr, -1,
                                    methods};

PyMODINIT_FUNC PyInit_parity_host_native(void) {
  g_local_name = PyUnicode_InternFromString("_local_tensor");
  if (g_local_name == nullptr) return nullptr;
  return PyModule_Create(&module);
}
