// BOOL_SWITCH(cond, NAME, ...): turn a runtime flag into the compile-time constant NAME inside
// the body, instantiating it twice. Use only for flags that change the inner loops.
#pragma once

#define BOOL_SWITCH(COND, CONST_NAME, ...)      \
  [&] {                                         \
    if (COND) {                                 \
      constexpr static bool CONST_NAME = true;  \
      return __VA_ARGS__();                     \
    } else {                                    \
      constexpr static bool CONST_NAME = false; \
      return __VA_ARGS__();                     \
    }                                           \
  }()
