// numpy's complex64 arithmetic: the textbook product, Smith's quotient (npy_math's order)
inline float2 cmul(float2 a, float2 b) { return (float2)(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }
inline float2 cdiv(float2 a, float2 b) {
  float ar = fabs(b.x), ai = fabs(b.y);
  if (ar >= ai) {
    if (ar == 0.0f && ai == 0.0f) return (float2)(a.x / ar, a.y / ar);
    float rat = b.y / b.x, scl = 1.0f / (b.x + b.y * rat);
    return (float2)((a.x + a.y * rat) * scl, (a.y - a.x * rat) * scl);
  }
  float rat = b.x / b.y, scl = 1.0f / (b.y + b.x * rat);
  return (float2)((a.x * rat + a.y) * scl, (a.y * rat - a.x) * scl);
}
