/* Stand-in for bridge.cpp in plain cargo builds on machines without Python headers (build.rs says why):
 * the module builds, and importing it fails with that reason. maturin builds always use bridge.cpp. */
int k3py_bridge_init(void* module) { (void)module; return -2; }
int k3py_array_from_py(void* res, void* obj) { (void)res; (void)obj; return 2; }
int k3py_array_to_py(void* res, void* a) { (void)res; (void)a; return 2; }
int k3py_is_array(void* obj) { (void)obj; return 0; }
