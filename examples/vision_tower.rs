//! Times a vision tower and projector with random weights on the default device: Kimi K2.5's MoonViT
//! (mlx-vlm's default sizes, Kimi K2's text width 7168) or, with `k3` first, Kimi K3's MoonViT-3d (mlx-vlm's
//! `kimi_k3` `VisionConfig` defaults: 27 blocks of width 1024, 12 heads of 128, MLP 4096, projector to
//! 7168). One image of `SIDE x SIDE` pixels (patches of 14, so 448 gives a 32 x 32 grid, 1,024 patches, 256
//! tokens), or with `FRAMES` a video chunk of that many such frames (the towers pool a chunk's frames into
//! one set of tokens); `REPS` encodes after one warm-up, each evaluated.
//!
//!     cargo run --release -p mlx-k3 --example vision_tower -- [k3] [SIDE [REPS [DEPTH [FRAMES]]]]
//!
//! DEPTH (default 27) shortens the tower for a quick run. f32 weights and activations. Prints wall time and,
//! on Linux, the process's CPU time (all threads) per encode, which a machine shared with other work
//! inflates less; for a chunk also the time per second of video at 2 frames per second (Kimi K2.5's
//! `sample_fps`, the default of `generate --video`).
use std::time::Instant;

use mlx_k3::model::vision::moonvit::{MoonVit, MoonVitConfig};
use mlx_k3::model::vision::moonvit3d::{MoonVit3d, VisionConfig};
use mlx_k3::model::vision::MediaGrid;
use mlx_k3::{random, Array, Dtype, Result};

/// The process's user + system CPU seconds (Linux `/proc/self/stat`, 100 ticks a second); None elsewhere.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesized command name: state is field 3, utime 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

enum Tower {
    K25(MoonVit),
    K3(MoonVit3d),
}

impl Tower {
    fn encode(&self, pixels: &Array, grid: MediaGrid) -> Result<Array> {
        match self {
            Tower::K25(t) => t.encode(pixels, &[grid]),
            Tower::K3(t) => t.encode(pixels, &[grid]),
        }
    }
    fn tokens_for(&self, grid: MediaGrid) -> usize {
        match self {
            Tower::K25(t) => t.tokens_for(grid),
            Tower::K3(t) => t.tokens_for(grid),
        }
    }
}

fn main() -> Result<()> {
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    let k3 = argv.first().is_some_and(|a| a == "k3");
    if k3 {
        argv.remove(0);
    }
    let args: Vec<usize> =
        argv.iter().map(|a| a.parse().expect("SIDE REPS DEPTH FRAMES are integers (or k3 first)")).collect();
    let side = args.first().copied().unwrap_or(448);
    let reps = args.get(1).copied().unwrap_or(3).max(1);
    let frames = args.get(3).copied().unwrap_or(1).max(1);
    let p = 14;
    let n = side / p;
    let n = n - n % 2;
    let grid = if frames > 1 { MediaGrid::video(frames, n, n) } else { MediaGrid::image(n, n) };
    let t0 = Instant::now();
    let (tower, depth) = if k3 {
        let mut cfg = VisionConfig::parse(&serde_json::json!({}), std::path::Path::new("mlx-vlm defaults"))?;
        if let Some(&d) = args.get(2) {
            cfg.vt_num_hidden_layers = d;
        }
        let depth = cfg.vt_num_hidden_layers;
        (Tower::K3(MoonVit3d::random(cfg, 7168, 1)?), depth)
    } else {
        let mut cfg = MoonVitConfig::defaults(7168);
        if let Some(&d) = args.get(2) {
            cfg.depth = d;
        }
        let depth = cfg.depth;
        (Tower::K25(MoonVit::random(cfg, 1)?), depth)
    };
    let name = if k3 { "Kimi K3 MoonViT-3d" } else { "Kimi K2.5 MoonViT" };
    println!("random {name} tower ({depth} blocks) built in {:.1} s", t0.elapsed().as_secs_f64());
    let pixels = random::uniform(-1.0, 1.0, &[(frames * n * n) as i32, 3, p as i32, p as i32], Dtype::F32, None)?;
    pixels.eval()?;
    tower.encode(&pixels, grid)?.eval()?;
    let mut times = Vec::with_capacity(reps);
    let cpu0 = cpu_seconds();
    for _ in 0..reps {
        let t = Instant::now();
        let out = tower.encode(&pixels, grid)?;
        out.eval()?;
        times.push(t.elapsed().as_secs_f64());
    }
    let what = if frames > 1 { "chunk" } else { "image" };
    if let (Some(a), Some(b)) = (cpu0, cpu_seconds()) {
        println!("CPU time {:.2} s per {what} (all threads)", (b - a) / reps as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let median = times[times.len() / 2];
    println!(
        "{side}x{side} x {frames} frame(s) ({n}x{n} patches each, {} tokens): median {median:.3} s per {what} over {reps} (min {:.3}, max {:.3})",
        tower.tokens_for(grid),
        times[0],
        times[times.len() - 1]
    );
    if frames > 1 {
        println!(
            "per second of video at 2 frames/s: {:.3} s ({frames} frames = {:.1} s)",
            median * 2.0 / frames as f64,
            frames as f64 / 2.0
        );
    }
    Ok(())
}
