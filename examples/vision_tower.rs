//! Times Kimi K2.5's MoonViT tower and projector (mlx-vlm's default sizes, Kimi K2's text width 7168) with
//! random weights on the default device: one image of `SIDE x SIDE` pixels (patches of 14, so 448 gives a
//! 32 x 32 grid, 1,024 patches, 256 tokens), `REPS` encodes after one warm-up, each evaluated.
//!
//!     cargo run --release -p mlx-k3 --example vision_tower -- [SIDE [REPS [DEPTH]]]
//!
//! DEPTH (default 27) shortens the tower for a quick run. f32 weights and activations: about 1.9 GB. Prints
//! wall time and, on Linux, the process's CPU time (all threads) per encode, which a machine shared with
//! other work inflates less.
use std::time::Instant;

use mlx_k3::model::vision::moonvit::{MoonVit, MoonVitConfig};
use mlx_k3::model::vision::MediaGrid;
use mlx_k3::{random, Dtype};

/// The process's user + system CPU seconds (Linux `/proc/self/stat`, 100 ticks a second); None elsewhere.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesized command name: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

fn main() -> mlx_k3::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("SIDE REPS DEPTH are integers")).collect();
    let side = args.first().copied().unwrap_or(448);
    let reps = args.get(1).copied().unwrap_or(3).max(1);
    let mut cfg = MoonVitConfig::defaults(7168);
    if let Some(&d) = args.get(2) {
        cfg.depth = d;
    }
    let p = cfg.patch_size;
    let n = side / p;
    let n = n - n % 2;
    let grid = MediaGrid::image(n, n);
    let t0 = Instant::now();
    let tower = MoonVit::random(cfg.clone(), 1)?;
    println!("random tower ({} blocks) built in {:.1} s", cfg.depth, t0.elapsed().as_secs_f64());
    let pixels = random::uniform(-1.0, 1.0, &[(n * n) as i32, 3, p as i32, p as i32], Dtype::F32, None)?;
    pixels.eval()?;
    tower.encode(&pixels, &[grid])?.eval()?;
    let mut times = Vec::with_capacity(reps);
    let cpu0 = cpu_seconds();
    for _ in 0..reps {
        let t = Instant::now();
        let out = tower.encode(&pixels, &[grid])?;
        out.eval()?;
        times.push(t.elapsed().as_secs_f64());
    }
    if let (Some(a), Some(b)) = (cpu0, cpu_seconds()) {
        println!("CPU time {:.2} s per image (all threads)", (b - a) / reps as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{side}x{side} ({n}x{n} patches, {} tokens): median {:.3} s per image over {reps} (min {:.3}, max {:.3})",
        tower.tokens_for(grid),
        times[times.len() / 2],
        times[0],
        times[times.len() - 1]
    );
    Ok(())
}
