// the availability probe: the smallest kernel, built and run once per device (device.py)
__kernel void rlx_probe(__global int *out) { int i = get_global_id(0); out[i] = 3 * i + 1; }
