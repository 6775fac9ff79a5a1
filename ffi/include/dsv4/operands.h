// An op's operands, stated once. Each contract header defines
//   #define DSV4_<OP>_OPERANDS(ATTR, ATTRS, ARG, ARGS, RET, RETS) ...
// listing the handler's operands in binding order: ATTR(type, name) an
// attribute (decoded by name), ATTRS(type, MEMBERS) the call's whole
// attribute dictionary decoded as a struct (dsv4/attrs.h; MEMBERS its member
// list, the parameter named `attrs`; no ATTR beside it), ARG(type, name) an
// argument, ARGS(name) the remaining arguments, RET(type, name) a result,
// RETS(name) the remaining results. From that one list come the binding
// (DSV4_BIND), the handler's parameters (DSV4_PARAMS: both handlers and the
// op's validation take them) and their names (DSV4_NAMES), and the list
// _dsv4_cpu.operands() hands to Python (DSV4_OPERAND_LIST, a struct's
// members each an "attr"), from which the call sites find their aliases.
//
// Names: an argument updated in place is named `<result>_in` after the
// result it is aliased to (errors_in -> errors); a state leaf is named by its
// path with dots as underscores (swa.pos -> swa_pos). A type with a comma
// needs an alias (apply_step.h) to pass through the macro.
#pragma once

#include <utility>
#include <vector>

#define DSV4_BIND_ATTR_(T, name) .template Attr<T>(#name)
#define DSV4_BIND_ATTRS_(T, MEMBERS) .template Attrs<T>()
#define DSV4_BIND_ARG_(T, name) .template Arg<T>()
#define DSV4_BIND_ARGS_(name) .RemainingArgs()
#define DSV4_BIND_RET_(T, name) .template Ret<T>()
#define DSV4_BIND_RETS_(name) .RemainingRets()
// `binding`: ffi::Ffi::Bind(), with the CUDA handlers' stream context.
#define DSV4_BIND(OPERANDS, binding)                                                    \
  (binding) OPERANDS(DSV4_BIND_ATTR_, DSV4_BIND_ATTRS_, DSV4_BIND_ARG_, DSV4_BIND_ARGS_,   \
                     DSV4_BIND_RET_, DSV4_BIND_RETS_)

// Each item expands with a leading comma; DSV4_DROP_FIRST_ drops the first.
#define DSV4_DROP_FIRST_(...) DSV4_DROP_FIRST2_(__VA_ARGS__)
#define DSV4_DROP_FIRST2_(first, ...) __VA_ARGS__

#define DSV4_PARAM_ATTR_(T, name) , T name
#define DSV4_PARAM_ATTRS_(T, MEMBERS) , T attrs
#define DSV4_PARAM_ARG_(T, name) , T name
#define DSV4_PARAM_ARGS_(name) , ffi::RemainingArgs name
#define DSV4_PARAM_RET_(T, name) , ffi::Result<T> name
#define DSV4_PARAM_RETS_(name) , ffi::RemainingRets name
#define DSV4_PARAMS(OPERANDS)                                                           \
  DSV4_DROP_FIRST_(OPERANDS(DSV4_PARAM_ATTR_, DSV4_PARAM_ATTRS_, DSV4_PARAM_ARG_,        \
                            DSV4_PARAM_ARGS_, DSV4_PARAM_RET_, DSV4_PARAM_RETS_))

#define DSV4_NAME_TYPED_(T, name) , name
#define DSV4_NAME_(name) , name
#define DSV4_NAME_ATTRS_(T, MEMBERS) , attrs
#define DSV4_NAMES(OPERANDS)                                                            \
  DSV4_DROP_FIRST_(OPERANDS(DSV4_NAME_TYPED_, DSV4_NAME_ATTRS_, DSV4_NAME_TYPED_, DSV4_NAME_, \
                            DSV4_NAME_TYPED_, DSV4_NAME_))

#define DSV4_LIST_ATTR_(T, name) {"attr", #name},
#define DSV4_LIST_ATTRS_(T, MEMBERS) MEMBERS(DSV4_LIST_ATTR_)
#define DSV4_LIST_ARG_(T, name) {"arg", #name},
#define DSV4_LIST_ARGS_(name) {"args", #name},
#define DSV4_LIST_RET_(T, name) {"ret", #name},
#define DSV4_LIST_RETS_(name) {"rets", #name},
// (role, name) per operand, in binding order; roles "attr" (a struct's
// members too, in its order), "arg", "args" (the remaining arguments), "ret",
// "rets" (the remaining results).
#define DSV4_OPERAND_LIST(OPERANDS)                                                     \
  std::vector<std::pair<const char*, const char*>> {                                    \
    OPERANDS(DSV4_LIST_ATTR_, DSV4_LIST_ATTRS_, DSV4_LIST_ARG_, DSV4_LIST_ARGS_,         \
             DSV4_LIST_RET_, DSV4_LIST_RETS_)                                            \
  }
