//! The adaptive gate's flags (`--gate-*`), shared by `generate`, `chat`, `serve` and `bench`.

use clap::Args as ClapArgs;

use mlx_k3::generate::speculative::{GateConfig, GateCost, MAX_DRAFT};
use mlx_k3::{Error, Result};

/// The most tokens one drafting cycle can emit (the most drafts, the limit of `--num-draft`, and the model's
/// own).
const MAX_TOKENS_PER_CYCLE: f32 = (MAX_DRAFT + 1) as f32;

/// Thresholds and windows of the adaptive gate (speculative decoding). Unset flags keep the defaults, which
/// docs/performance.md#speculative-decoding justifies (k3-nano's measured break-even).
#[derive(ClapArgs, Debug, Clone, Default)]
pub struct GateArgs {
    /// With --draft-model: what the gate weighs drafting by: `time` (a drafting cycle's measured tokens per
    /// second against the request's own timed plain decode steps, counting the drafter's cost) or `tokens`
    /// (tokens per cycle against --gate-short/--gate-long: the same decisions on every greedy run)
    /// [default: time].
    #[arg(long, value_name = "time|tokens", value_parser = ["time", "tokens"])]
    pub gate_cost: Option<String>,
    /// With --gate-cost time: fall back to plain decoding when drafting's tokens per second over the short
    /// window are below this share of plain decoding's [default: 0.9: a dip is tolerated].
    #[arg(long, value_name = "SHARE", allow_negative_numbers = true)]
    pub gate_speed_short: Option<f32>,
    /// With --gate-cost time: ...or over the long window below this share [default: 1.0: break-even].
    #[arg(long, value_name = "SHARE", allow_negative_numbers = true)]
    pub gate_speed_long: Option<f32>,
    /// With --gate-cost time: plain decode steps a request times before its first probe [default: 4].
    #[arg(long, value_name = "STEPS")]
    pub gate_measure_steps: Option<usize>,
    /// With --gate-cost tokens: fall back to plain decoding when the mean tokens per drafting cycle (kept drafts
    /// + 1) over the short window is below this [default: 3.0, the measured break-even of 3 drafts on
    /// k3-nano].
    #[arg(long, value_name = "TOKENS", allow_negative_numbers = true)]
    pub gate_short: Option<f32>,
    /// ...or when the long window's mean is below this [default: 3.3, the break-even of 5 drafts].
    #[arg(long, value_name = "TOKENS", allow_negative_numbers = true)]
    pub gate_long: Option<f32>,
    /// Drafting cycles in the gate's short window [default: 8].
    #[arg(long, value_name = "CYCLES")]
    pub gate_short_window: Option<usize>,
    /// Drafting cycles in the gate's long window [default: 16].
    #[arg(long, value_name = "CYCLES")]
    pub gate_long_window: Option<usize>,
    /// Draft counts the gate chooses from by acceptance, increasing, comma-separated [default: 3,5,7];
    /// --num-draft caps them.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',')]
    pub gate_drafts: Option<Vec<usize>>,
    /// Acceptance rates (kept / drafted over the short window, 0 to 1, non-decreasing) at which the 2nd,
    /// 3rd, ... of --gate-drafts is used, comma-separated [default: 0.6,0.8].
    #[arg(long, value_name = "RATE,...", value_delimiter = ',')]
    pub gate_raise_at: Option<Vec<f32>>,
    /// Plain tokens after a fallback before drafting is probed again (doubling after each failed probe, up
    /// to 16x) [default: 64].
    #[arg(long, value_name = "TOKENS")]
    pub gate_probe_after: Option<usize>,
    /// Drafting cycles a probe runs before it decides; a cycle that keeps no draft decides at once [default:
    /// 2].
    #[arg(long, value_name = "CYCLES")]
    pub gate_probe_cycles: Option<usize>,
}

impl GateArgs {
    fn given(&self) -> impl Iterator<Item = &'static str> + '_ {
        [
            (self.gate_cost.is_some(), "--gate-cost"),
            (self.gate_speed_short.is_some(), "--gate-speed-short"),
            (self.gate_speed_long.is_some(), "--gate-speed-long"),
            (self.gate_measure_steps.is_some(), "--gate-measure-steps"),
            (self.gate_short.is_some(), "--gate-short"),
            (self.gate_long.is_some(), "--gate-long"),
            (self.gate_short_window.is_some(), "--gate-short-window"),
            (self.gate_long_window.is_some(), "--gate-long-window"),
            (self.gate_drafts.is_some(), "--gate-drafts"),
            (self.gate_raise_at.is_some(), "--gate-raise-at"),
            (self.gate_probe_after.is_some(), "--gate-probe-after"),
            (self.gate_probe_cycles.is_some(), "--gate-probe-cycles"),
        ]
        .into_iter()
        .filter(|(set, _)| *set)
        .map(|(_, name)| name)
    }

    /// The gate's settings; an error names the flag at fault. `drafting` says whether a drafter was given
    /// and `gated` whether the gate runs (not `--no-gate`): gate flags without either would change nothing,
    /// so they are refused rather than ignored.
    pub fn config(&self, drafting: bool, gated: bool) -> Result<GateConfig> {
        let bad = |m: String| Err(Error::invalid("cli", m));
        if let Some(flag) = self.given().next() {
            if !drafting {
                return bad(format!("{flag} needs --draft-model (it sets the speculative gate)"));
            }
            if !gated {
                return bad(format!("{flag} has no effect with --no-gate (which always drafts --num-draft)"));
            }
        }
        let mut c = GateConfig::default();
        if self.gate_cost.as_deref() == Some("tokens") {
            c.cost = GateCost::Tokens;
        }
        // A threshold of the other measure would change nothing: refused, naming what it needs.
        let (other, needs) = match c.cost {
            GateCost::Time => (
                vec![(self.gate_short.is_some(), "--gate-short"), (self.gate_long.is_some(), "--gate-long")],
                "--gate-cost tokens",
            ),
            GateCost::Tokens => (
                vec![
                    (self.gate_speed_short.is_some(), "--gate-speed-short"),
                    (self.gate_speed_long.is_some(), "--gate-speed-long"),
                    (self.gate_measure_steps.is_some(), "--gate-measure-steps"),
                ],
                "--gate-cost time (the default)",
            ),
        };
        if let Some((_, flag)) = other.iter().find(|(set, _)| *set) {
            return bad(format!("{flag} applies with {needs} only"));
        }
        for (flag, v, slot, unit) in [
            ("--gate-speed-short", self.gate_speed_short, &mut c.speed_short, "a share of plain decoding's speed"),
            ("--gate-speed-long", self.gate_speed_long, &mut c.speed_long, "a share of plain decoding's speed"),
            ("--gate-short", self.gate_short, &mut c.fallback_short, "a number of tokens per cycle"),
            ("--gate-long", self.gate_long, &mut c.fallback_long, "a number of tokens per cycle"),
        ] {
            if let Some(v) = v {
                if !(0.0..=MAX_TOKENS_PER_CYCLE).contains(&v) {
                    return bad(format!("{flag} must be {unit} from 0 to {MAX_TOKENS_PER_CYCLE}, got {v}"));
                }
                *slot = v;
            }
        }
        for (flag, v, slot) in [
            ("--gate-short-window", self.gate_short_window, &mut c.short_window),
            ("--gate-long-window", self.gate_long_window, &mut c.long_window),
            ("--gate-probe-after", self.gate_probe_after, &mut c.probe_after),
            ("--gate-probe-cycles", self.gate_probe_cycles, &mut c.probe_cycles),
            ("--gate-measure-steps", self.gate_measure_steps, &mut c.measure_steps),
        ] {
            if let Some(v) = v {
                if v == 0 || v > 1 << 20 {
                    return bad(format!("{flag} must be from 1 to {}, got {v}", 1 << 20));
                }
                *slot = v;
            }
        }
        if c.short_window > c.long_window {
            return bad(format!(
                "--gate-short-window ({}) must not exceed --gate-long-window ({})",
                c.short_window, c.long_window
            ));
        }
        if let Some(d) = &self.gate_drafts {
            if d.is_empty() || d.iter().any(|&k| k == 0 || k > MAX_DRAFT) || d.windows(2).any(|w| w[0] >= w[1]) {
                return bad(format!("--gate-drafts must be increasing counts from 1 to {MAX_DRAFT}, got {d:?}"));
            }
            c.drafts = d.clone();
            if self.gate_raise_at.is_none() {
                if d.len() != GateConfig::default().drafts.len() {
                    return bad(format!(
                        "--gate-drafts with {} counts needs --gate-raise-at with {} rates",
                        d.len(),
                        d.len() - 1
                    ));
                }
            }
        }
        if let Some(r) = &self.gate_raise_at {
            if r.len() + 1 != c.drafts.len() {
                return bad(format!(
                    "--gate-raise-at needs {} rates (one per draft count after the first of {:?}), got {}",
                    c.drafts.len() - 1,
                    c.drafts,
                    r.len()
                ));
            }
            if r.iter().any(|x| !(0.0..=1.0).contains(x)) || r.windows(2).any(|w| w[0] > w[1]) {
                return bad(format!("--gate-raise-at must be non-decreasing rates from 0 to 1, got {r:?}"));
            }
            c.raise_at = r.clone();
        }
        c.validate()?;
        Ok(c)
    }
}
