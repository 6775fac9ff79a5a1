// Attributes decoded as types, by XLA FFI's enum and struct decoding
// (xla/ffi/api/api.h): kv_format as the KvFormat enum (dsv4/layout.h), and
// the attributes every write op shares (append, flush, write_layer) as one
// struct, which those handlers bind as the call's whole attribute dictionary
// (ATTRS in dsv4/operands.h) and check in one place (CheckWriteAttrs).
//
// jax's ffi_call turns a Python int into an i64 scalar, and a decoder takes a
// scalar of exactly its type: so int64_t is KvFormat's underlying type and
// every member's. The enum decoding casts whatever i64 comes, so
// CheckKvFormat still rejects a value outside the enum. The struct decoding
// wants the dictionary to hold exactly its members (a missing or an extra
// attribute fails the call) and cannot be bound beside a named attribute: so
// append takes max_rows_per_slot too, though no append kernel reads it.
//
// Each registration specializes templates of xla::ffi, so it sits at global
// scope, once per type, in this header only; identical specializations in
// several translation units are allowed (a class's definition may repeat).
#pragma once

#include <cstdint>
#include <string>

#include "dsv4/entry_checks.h"
#include "dsv4/layout.h"
#include "dsv4/operands.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(::dsv4::KvFormat);

// A struct's members, MEMBER(type, name) each (types spelled from the global
// scope: the registration expands inside namespace xla::ffi).
#define DSV4_WRITE_ATTRS(MEMBER)                                                            \
  MEMBER(::dsv4::KvFormat, kv_format) MEMBER(int64_t, max_context)                          \
  MEMBER(int64_t, max_rows_per_slot)

#define DSV4_STRUCT_FIELD_(T, name) T name;
#define DSV4_STRUCT_MEMBER_(T, name) , ::xla::ffi::StructMember<T>(#name)

namespace dsv4 {

// max_rows_per_slot: the caller's static bound on any slot's rows in the call
// (0: none), a hint for the flush kernels' choice only.
struct WriteAttrs {
  DSV4_WRITE_ATTRS(DSV4_STRUCT_FIELD_)
};

// Every write op's check of its attributes.
inline ffi::Error CheckWriteAttrs(const WriteAttrs& attrs) {
  DSV4_RETURN_IF_ERROR(CheckKvFormat(attrs.kv_format));
  DSV4_RETURN_IF_ERROR(CheckMaxContext(attrs.max_context));
  if (attrs.max_rows_per_slot < 0)
    return ffi::Error::InvalidArgument("max_rows_per_slot: expected >= 0 (0: no bound), got " +
                                       std::to_string(attrs.max_rows_per_slot));
  return ffi::Error::Success();
}

}  // namespace dsv4

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::dsv4::WriteAttrs,
                                      DSV4_DROP_FIRST_(DSV4_WRITE_ATTRS(DSV4_STRUCT_MEMBER_)));
