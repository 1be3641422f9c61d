//! Two real ranks on localhost, started by MLX's own launcher over the ring back-end, run
//! `mlx-k3 dist-check` (all_sum and all_gather of known arrays, verified on every rank).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn launcher() -> PathBuf {
    let python = PathBuf::from(env!("MLX_K3_PYTHON"));
    assert!(python.exists(), "MLX's Python environment was not recorded at build time");
    python.with_file_name("mlx.launch")
}

#[test]
fn two_ranks_all_sum_over_ring() {
    let bin = env!("CARGO_BIN_EXE_mlx-k3");
    // A port range of our own so parallel test runs do not collide.
    let port = 20_000 + (std::process::id() % 20_000) as u16;
    let mut child = Command::new(launcher())
        .args(["-n", "2", "--backend", "ring", "--starting-port", &port.to_string(), bin, "dist-check"])
        .args(["--elements", "4096"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start mlx.launch");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("two-rank dist-check did not finish within 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "mlx.launch failed: {}\n{stdout}\n{stderr}", out.status);
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("rank {rank}/2: all_sum and all_gather ok (4096 elements")),
            "rank {rank} did not report success:\n{stdout}\n{stderr}"
        );
    }
}
