#define DEF_INT(T) \
inline T fdiv_##T(T a, T b) { if (b == 0) return 0; T q = a / b; if ((a % b != 0) && ((a < 0) != (b < 0))) q -= 1; return q; } \
inline T udiv_##T(T a, T b) { return b == 0 ? 0 : a / b; } \
inline T ipow_##T(T a, T b) { T r = 1; if (b < 0) return 0; while (b > 0) { if (b & 1) r *= a; a *= a; b >>= 1; } return r; }
DEF_INT(char) DEF_INT(short) DEF_INT(int) DEF_INT(long) DEF_INT(uchar) DEF_INT(uint)
