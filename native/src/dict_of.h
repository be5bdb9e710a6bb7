// A plain C++ report (the proxy's stats, a verbs lane or connection) as the Python dict its
// binding returns, keyed by the field names: each binding lists its fields once, so a key
// cannot drift from the field it reports, and a new field is one more entry.
#pragma once
#include <nanobind/nanobind.h>

namespace sparkccl {

// One dict entry: its key and how to read its value from the struct.
template <class Get>
struct DictField {
  const char* key;
  Get get;
};

template <class Get>
DictField<Get> dict_field(const char* key, Get get) {
  return {key, get};
}

template <class S, class... Get>
nanobind::dict dict_of(const S& s, const DictField<Get>&... fields) {
  nanobind::dict d;
  ((d[fields.key] = fields.get(s)), ...);
  return d;
}

}  // namespace sparkccl

// The entry for the struct's field `name`, under the key "name".
#define SPARKCCL_FIELD(name) ::sparkccl::dict_field(#name, [](const auto& s) { return s.name; })
