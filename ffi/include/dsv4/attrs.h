// Attributes decoded as types, by XLA FFI's enum decoding (xla/ffi/api/api.h):
// kv_format as the KvFormat enum (dsv4/layout.h).
//
// jax's ffi_call turns a Python int into an i64 scalar, and a decoder takes a
// scalar of exactly its type: so int64_t is KvFormat's underlying type. The
// enum decoding casts whatever i64 comes, so CheckKvFormat still rejects a
// value outside the enum.
//
// Each registration specializes templates of xla::ffi, so it sits at global
// scope, once per type, in this header only; identical specializations in
// several translation units are allowed (a class's definition may repeat).
#pragma once

#include "dsv4/layout.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(::dsv4::KvFormat);
