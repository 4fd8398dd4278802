// little-endian fields of a packed block, read byte by byte (blocks are not aligned)
inline float f16_at(__global const uchar* p) { return vload_half(0, (__global const half*)p); }
inline uint u32_at(__global const uchar* p) {
  return (uint)p[0] | ((uint)p[1] << 8) | ((uint)p[2] << 16) | ((uint)p[3] << 24);
}
inline float f32_at(__global const uchar* p) { return as_float(u32_at(p)); }
