// Python binding of the native layer (placeholder until the proxy lands).
#include <nanobind/nanobind.h>
namespace nb = nanobind;
NB_MODULE(_native, m) { m.attr("ABI_VERSION") = 1; }
