//! Builds the nanobind bridge (`cpp/bridge.cpp` plus nanobind's combined source) that exchanges `mx.array`
//! with MLX's C++ `array`, and sets the extension's RUNPATH so it loads the wheel's `libmlx` and no other.
//!
//! - nanobind: pinned in `pyproject.toml` (`nanobind==X` in `build-system.requires`). pip's build isolation
//!   provides it under maturin; otherwise the interpreter's own copy is used when its version matches, else
//!   the pinned version is installed into `OUT_DIR` with `pip install --target` (nothing else is touched).
//! - The bridge is compiled with `-DNB_DOMAIN=mlx -fvisibility=hidden -fno-strict-aliasing`: the domain and
//!   nanobind version give the same internals key as the mlx wheel, so nanobind finds `mx.array`'s type.
//! - Python headers come from the interpreter pyo3 builds for (`PYO3_PYTHON`, the active virtualenv, then
//!   `python3`), the MLX headers and library from `mlx-k3-sys` (`DEP_MLX_*`).
//! - Under maturin (`PYO3_BUILD_EXTENSION_MODULE`) the bridge is required. A plain cargo build of the workspace
//!   on a machine without Python headers (or without pip to fetch nanobind) links `cpp/bridge_stub.c` instead
//!   and says why in a warning; importing such a build raises `ImportError` with that reason.
//! - RUNPATH: `$ORIGIN/../mlx/lib` (the `mlx` package next to `mlx_k3` in site-packages) first, then the
//!   absolute library folder of the build. Python's `mlx.core` always loads `libmlx` before this module
//!   (`mlx_k3/__init__.py` imports it first), and the loader reuses that copy by its soname.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    for var in ["PYO3_PYTHON", "VIRTUAL_ENV", "NANOBIND_DIR"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cpp");
    println!("cargo:rerun-if-changed=pyproject.toml");

    let libdir = env::var("DEP_MLX_LIBDIR").expect("DEP_MLX_LIBDIR from mlx-k3-sys");
    let mlx_include = env::var("DEP_MLX_INCLUDE").expect("DEP_MLX_INCLUDE from mlx-k3-sys");
    let shim_include = env::var("DEP_MLX_SHIM_INCLUDE").expect("DEP_MLX_SHIM_INCLUDE from mlx-k3-sys");

    // maturin (PYO3_BUILD_EXTENSION_MODULE) builds the real module: the bridge is required. A plain cargo build
    // of the workspace (`cargo test --workspace`) must work with just Rust and Python 3, so there a machine
    // without Python headers gets a stub bridge whose import fails with the reason.
    let strict = env::var_os("PYO3_BUILD_EXTENSION_MODULE").is_some()
        || env::var("MLX_K3_PY_REQUIRE_BRIDGE").is_ok_and(|v| v == "1");
    println!("cargo:rerun-if-env-changed=PYO3_BUILD_EXTENSION_MODULE");
    println!("cargo:rerun-if-env-changed=MLX_K3_PY_REQUIRE_BRIDGE");
    let pin = nanobind_pin(&manifest.join("pyproject.toml"));
    match bridge_inputs(&pin, &out) {
        Ok((py_include, nb)) => compile_bridge(&manifest, &py_include, &nb, &mlx_include, &shim_include),
        Err(reason) if !strict => {
            println!("cargo:warning=mlx-k3-py: building without the bridge to mx.array: {reason}");
            println!("cargo:rustc-env=MLX_K3_PY_NO_BRIDGE={}", reason.replace(['\n', '\r'], " "));
            cc::Build::new().file(manifest.join("cpp/bridge_stub.c")).compile("mlx_k3_py_bridge");
        }
        Err(reason) => fail(&reason),
    }

    // Symbols of the interpreter stay undefined in the module (it is loaded into Python).
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        println!("cargo:rustc-cdylib-link-arg=-undefined");
        println!("cargo:rustc-cdylib-link-arg=dynamic_lookup");
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,@loader_path/../mlx/lib");
    } else {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN/../mlx/lib");
    }
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,{libdir}");
    println!("cargo:rustc-env=MLX_K3_PY_NANOBIND={pin}");
}

/// The Python include folder and nanobind's package folder, or why they are not available.
fn bridge_inputs(pin: &str, out: &Path) -> Result<(String, PathBuf), String> {
    let python = python_interpreter();
    let py_include = query(&python, "import sysconfig; print(sysconfig.get_paths()['include'])")
        .map_err(|e| format!("cannot ask {} for its include folder: {e}", python.display()))?;
    if !Path::new(&py_include).join("Python.h").exists() {
        return Err(format!(
            "{py_include}/Python.h is missing: the bridge needs the Python headers of {} \
             (Debian/Ubuntu: apt-get install python3-dev)",
            python.display()
        ));
    }
    Ok((py_include, nanobind_dir(&python, pin, out)?))
}

fn compile_bridge(manifest: &Path, py_include: &str, nb: &Path, mlx_include: &str, shim_include: &str) {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .opt_level(2)
        .define("NB_DOMAIN", "mlx")
        .define("NDEBUG", None)
        .define("NB_COMPACT_ASSERTIONS", None)
        .flag("-fvisibility=hidden")
        .flag("-fno-strict-aliasing")
        .flag_if_supported("-ffunction-sections")
        .flag_if_supported("-fdata-sections")
        .include(manifest.join("cpp"))
        .include(shim_include)
        .warnings(false);
    let nb_include = nb.join("include");
    let robin_map = nb.join("ext/robin_map/include");
    for dir in [Path::new(py_include), &nb_include, &robin_map, Path::new(mlx_include)] {
        build.flag("-isystem").flag(dir.to_str().expect("UTF-8 path"));
    }
    build.file(nb.join("src/nb_combined.cpp"));
    build.file(manifest.join("cpp/bridge.cpp"));
    build.compile("mlx_k3_py_bridge");
}

fn fail(msg: &str) -> ! {
    eprintln!("\nerror: mlx-k3-py: {msg}\n");
    panic!("mlx-k3-py: {msg}");
}

/// The interpreter pyo3 builds for, found the way pyo3 finds it.
fn python_interpreter() -> PathBuf {
    if let Ok(p) = env::var("PYO3_PYTHON") {
        return PathBuf::from(p);
    }
    if let Ok(venv) = env::var("VIRTUAL_ENV") {
        let p = Path::new(&venv).join("bin/python");
        if p.exists() {
            return p;
        }
    }
    PathBuf::from("python3")
}

fn query(python: &Path, code: &str) -> Result<String, String> {
    let out = Command::new(python).args(["-c", code]).output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `X` from `"nanobind==X"` in pyproject.toml's build requirements (the one place the pin lives).
fn nanobind_pin(pyproject: &Path) -> String {
    let text = fs::read_to_string(pyproject).unwrap_or_else(|e| fail(&format!("{}: {e}", pyproject.display())));
    text.split('"')
        .find_map(|s| s.strip_prefix("nanobind=="))
        .map(str::to_string)
        .unwrap_or_else(|| fail(&format!("{} pins no nanobind (\"nanobind==X\")", pyproject.display())))
}

/// nanobind's package folder (holding `include/`, `src/` and `ext/`) at exactly the pinned version.
fn nanobind_dir(python: &Path, pin: &str, out: &Path) -> Result<PathBuf, String> {
    if let Ok(dir) = env::var("NANOBIND_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let ask = "import nanobind, os; print(nanobind.__version__); print(os.path.dirname(nanobind.__file__))";
    if let Ok(text) = query(python, ask) {
        let mut lines = text.lines();
        if let (Some(version), Some(dir)) = (lines.next(), lines.next()) {
            if version == pin {
                return Ok(PathBuf::from(dir));
            }
            println!(
                "cargo:warning=mlx-k3-py: {} has nanobind {version}, not {pin}; using a private copy",
                python.display()
            );
        }
    }
    // A private copy in OUT_DIR (pip of this interpreter, else of the MLX environment's).
    let target = out.join("nanobind-pkg");
    let dir = target.join("nanobind");
    if dir.join("src/nb_combined.cpp").exists() {
        return Ok(dir);
    }
    let mut pythons = vec![python.to_path_buf()];
    pythons.extend(env::var("DEP_MLX_PYTHON").ok().filter(|p| !p.is_empty()).map(PathBuf::from));
    let mut errors = Vec::new();
    for py in pythons {
        let out = Command::new(&py)
            .args(["-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps", "--target"])
            .arg(&target)
            .arg(format!("nanobind=={pin}"))
            .output();
        match out {
            Ok(o) if o.status.success() && dir.join("src/nb_combined.cpp").exists() => return Ok(dir),
            Ok(o) => errors.push(format!("{} -m pip: {}", py.display(), String::from_utf8_lossy(&o.stderr).trim())),
            Err(e) => errors.push(format!("{}: {e}", py.display())),
        }
    }
    Err(format!(
        "could not install nanobind=={pin} ({}); install it in the build's Python or set NANOBIND_DIR",
        errors.join("; ")
    ))
}
