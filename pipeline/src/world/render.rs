//! Ray casting of the [`Scene`]: per pixel, a walk through the grid (DDA) to the first solid,
//! against the floor or ceiling plane, with procedural textures, a fixed light and distance fog.
//! The rays are the engine's: the same intrinsics, scaled to the frame size, through the same
//! pixel centres as the DiT's ray map ([`crate::camera::ray_map`]).

use crate::camera::{CameraConfig, Pose};

use super::scene::{Scene, Solid, CEILING_Y, CRATE_TOP_Y, FLOOR_Y};

type Rgb = [f64; 3];

/// Colours of a region: its four wall faces (facing +x, −x, +z, −z), floor and ceiling, and the
/// wall pattern.
struct Palette {
    walls: [Rgb; 4],
    floor: Rgb,
    ceiling: Rgb,
    pattern: Pattern,
}

#[derive(Clone, Copy)]
enum Pattern {
    Bricks,
    Planks,
    Panels,
}

const fn palette(walls: [Rgb; 4], floor: Rgb, ceiling: Rgb, pattern: Pattern) -> Palette {
    Palette {
        walls,
        floor,
        ceiling,
        pattern,
    }
}

/// Regions 0–7 (0: outside, never seen; 6: unused).
const PALETTES: [Palette; 8] = [
    palette([[0.5; 3]; 4], [0.3; 3], [0.6; 3], Pattern::Panels),
    palette(
        [
            [0.78, 0.26, 0.20],
            [0.88, 0.58, 0.20],
            [0.86, 0.80, 0.60],
            [0.52, 0.30, 0.20],
        ],
        [0.45, 0.50, 0.62],
        [0.80, 0.78, 0.74],
        Pattern::Bricks,
    ),
    palette(
        [
            [0.20, 0.40, 0.82],
            [0.25, 0.72, 0.72],
            [0.30, 0.62, 0.30],
            [0.62, 0.72, 0.92],
        ],
        [0.62, 0.44, 0.26],
        [0.70, 0.78, 0.86],
        Pattern::Planks,
    ),
    palette(
        [
            [0.62, 0.30, 0.72],
            [0.88, 0.46, 0.62],
            [0.46, 0.36, 0.82],
            [0.82, 0.72, 0.86],
        ],
        [0.26, 0.46, 0.30],
        [0.84, 0.76, 0.84],
        Pattern::Panels,
    ),
    palette(
        [
            [0.82, 0.76, 0.20],
            [0.50, 0.76, 0.26],
            [0.92, 0.90, 0.52],
            [0.42, 0.52, 0.16],
        ],
        [0.56, 0.30, 0.26],
        [0.86, 0.86, 0.72],
        Pattern::Bricks,
    ),
    palette(
        [
            [0.16, 0.56, 0.50],
            [0.76, 0.20, 0.36],
            [0.92, 0.62, 0.50],
            [0.30, 0.30, 0.52],
        ],
        [0.70, 0.70, 0.66],
        [0.60, 0.74, 0.72],
        Pattern::Planks,
    ),
    palette([[0.5; 3]; 4], [0.3; 3], [0.6; 3], Pattern::Panels),
    palette(
        [
            [0.56, 0.56, 0.56],
            [0.50, 0.50, 0.56],
            [0.62, 0.58, 0.50],
            [0.44, 0.44, 0.44],
        ],
        [0.22, 0.22, 0.24],
        [0.50, 0.50, 0.50],
        Pattern::Panels,
    ),
];

const FOG: Rgb = [0.07, 0.07, 0.09];
/// Metres over which fog takes `1 − 1/e` of the colour.
const FOG_DISTANCE: f64 = 16.0;
/// Towards the light (from above, y is down).
const LIGHT: [f64; 3] = [0.40, -0.80, 0.45];

/// What a ray hit.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Surface {
    Floor,
    Ceiling,
    /// A wall face with normal `face` (0: +x, 1: −x, 2: +z, 3: −z) seen from `region`.
    Wall {
        face: usize,
        region: u8,
    },
    Pillar {
        face: usize,
    },
    /// Face 4 is the top.
    Crate {
        face: usize,
    },
}

/// A renderer of the scene at one frame size.
#[derive(Clone, Debug)]
pub struct Renderer {
    scene: Scene,
    pub height: usize,
    pub width: usize,
    samples: usize,
    /// Camera-frame unit ray of every sample, pixel by pixel, row-major.
    rays: Vec<[f64; 3]>,
}

impl Renderer {
    /// `samples²` rays per pixel (1: one through the pixel centre, the ray map's own ray).
    pub fn new(
        scene: Scene,
        height: usize,
        width: usize,
        intrinsics_832x480: [f64; 4],
        samples: usize,
    ) -> Self {
        let samples = samples.max(1);
        let [fx, fy, cx, cy] = CameraConfig::intrinsics_px(intrinsics_832x480, height, width);
        let mut rays = Vec::with_capacity(height * width * samples * samples);
        for v in 0..height {
            for u in 0..width {
                for i in 0..samples {
                    for j in 0..samples {
                        let (ox, oy) = (
                            (j as f64 + 0.5) / samples as f64,
                            (i as f64 + 0.5) / samples as f64,
                        );
                        let d = [(u as f64 + ox - cx) / fx, (v as f64 + oy - cy) / fy, 1.0];
                        let n = (d[0] * d[0] + d[1] * d[1] + d[2] * d[2]).sqrt();
                        rays.push(d.map(|x| x / n));
                    }
                }
            }
        }
        Renderer {
            scene,
            height,
            width,
            samples,
            rays,
        }
    }

    pub fn scene(&self) -> &Scene {
        &self.scene
    }

    /// Bytes of one frame (`H·W·3`).
    pub fn frame_len(&self) -> usize {
        self.height * self.width * 3
    }

    /// Renders the view from world pose `pose` (camera-to-world) into `out`, RGB `[H, W, 3]`.
    pub fn render_into(&self, pose: &Pose, out: &mut [u8]) {
        let per_pixel = self.samples * self.samples;
        for (px, rgb) in out.chunks_exact_mut(3).enumerate() {
            let mut acc = [0.0; 3];
            for ray in &self.rays[px * per_pixel..][..per_pixel] {
                let c = self.shade(pose.t, pose.rotate(*ray));
                (0..3).for_each(|k| acc[k] += c[k]);
            }
            for k in 0..3 {
                rgb[k] = (acc[k] / per_pixel as f64 * 255.0)
                    .round()
                    .clamp(0.0, 255.0) as u8;
            }
        }
    }

    pub fn render(&self, pose: &Pose) -> Vec<u8> {
        let mut out = vec![0; self.frame_len()];
        self.render_into(pose, &mut out);
        out
    }

    /// The colour seen along `d` (unit) from `o`.
    fn shade(&self, o: [f64; 3], d: [f64; 3]) -> Rgb {
        let (t, surface) = self.cast(o, d);
        let p = [0, 1, 2].map(|k| o[k] + t * d[k]);
        let (base, normal) = surface_colour(&self.scene, surface, p);
        let lit = 0.72 + 0.28 * (0..3).map(|k| normal[k] * LIGHT[k]).sum::<f64>();
        let fog = (-t / FOG_DISTANCE).exp();
        [0, 1, 2].map(|k| base[k] * lit * fog + FOG[k] * (1.0 - fog))
    }

    /// Distance to and kind of the first surface along `d` from `o`.
    fn cast(&self, o: [f64; 3], d: [f64; 3]) -> (f64, Surface) {
        let (mut t_plane, mut plane) = (f64::INFINITY, Surface::Floor);
        if d[1] > 1e-12 {
            t_plane = (FLOOR_Y - o[1]) / d[1];
        } else if d[1] < -1e-12 {
            (t_plane, plane) = ((CEILING_Y - o[1]) / d[1], Surface::Ceiling);
        }
        let (mut col, mut row) = (o[0].floor() as i64, o[2].floor() as i64);
        let step = |v: f64| if v > 0.0 { 1 } else { -1 };
        let (sx, sz) = (step(d[0]), step(d[2]));
        let next = |p: f64, c: i64, s: i64, dv: f64| {
            if dv.abs() < 1e-12 {
                f64::INFINITY
            } else {
                let edge = if s > 0 { c as f64 + 1.0 } else { c as f64 };
                (edge - p) / dv
            }
        };
        let (mut tx, mut tz) = (next(o[0], col, sx, d[0]), next(o[2], row, sz, d[2]));
        let (dtx, dtz) = (1.0 / d[0].abs(), 1.0 / d[2].abs());
        let mut region = self.scene.region(row, col);
        // The map is closed, so a ray meets a wall within its width plus height in cells.
        for _ in 0..(self.scene.rows + self.scene.cols + 2) {
            if let Some(solid) = self.scene.solid(row, col) {
                if let Some((t, face)) = slab(o, d, &solid) {
                    if t < t_plane {
                        let s = match self.scene.cell(row, col) {
                            super::scene::Cell::Pillar => Surface::Pillar { face },
                            super::scene::Cell::Crate => Surface::Crate { face },
                            _ => Surface::Wall { face, region },
                        };
                        return (t, s);
                    }
                }
            } else {
                region = self.scene.region(row, col);
            }
            let t_next = tx.min(tz);
            if t_next > t_plane {
                break;
            }
            if tx < tz {
                col += sx;
                tx += dtx;
            } else {
                row += sz;
                tz += dtz;
            }
        }
        (t_plane, plane)
    }
}

/// Entry distance and face (0: +x, 1: −x, 2: +z, 3: −z, 4: top) of the ray into a box.
fn slab(o: [f64; 3], d: [f64; 3], b: &Solid) -> Option<(f64, usize)> {
    let (mut near, mut far, mut axis) = (f64::NEG_INFINITY, f64::INFINITY, 0);
    for k in 0..3 {
        if d[k].abs() < 1e-12 {
            if o[k] < b.lo[k] || o[k] > b.hi[k] {
                return None;
            }
            continue;
        }
        let (t1, t2) = ((b.lo[k] - o[k]) / d[k], (b.hi[k] - o[k]) / d[k]);
        let (lo, hi) = (t1.min(t2), t1.max(t2));
        if lo > near {
            (near, axis) = (lo, k);
        }
        far = far.min(hi);
    }
    if near > far || near < 0.0 {
        return None;
    }
    let face = match axis {
        0 if d[0] > 0.0 => 1,
        0 => 0,
        2 if d[2] > 0.0 => 3,
        2 => 2,
        _ => 4,
    };
    Some((near, face))
}

const NORMALS: [[f64; 3]; 5] = [
    [1.0, 0.0, 0.0],
    [-1.0, 0.0, 0.0],
    [0.0, 0.0, 1.0],
    [0.0, 0.0, -1.0],
    [0.0, -1.0, 0.0],
];

/// A stable pseudo-random value in [0, 1) for integer coordinates.
fn hash(a: i64, b: i64, c: i64) -> f64 {
    let mut h = (a as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ (b as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
        ^ (c as u64).wrapping_mul(0x1656_67b1_9e37_79f9);
    h ^= h >> 29;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 32;
    (h >> 11) as f64 / (1u64 << 53) as f64
}

fn scale(c: Rgb, s: f64) -> Rgb {
    c.map(|v| v * s)
}

/// Whether `v` is within `w` of a multiple of `period`.
fn near_line(v: f64, period: f64, w: f64) -> bool {
    let r = v.rem_euclid(period);
    r < w || r > period - w
}

/// Base colour and normal at point `p` of a surface.
fn surface_colour(scene: &Scene, s: Surface, p: [f64; 3]) -> (Rgb, [f64; 3]) {
    match s {
        Surface::Floor => {
            let (cx, cz) = (p[0].floor() as i64, p[2].floor() as i64);
            let region = region_at(scene, p);
            let checker = if (cx + cz).rem_euclid(2) == 0 {
                1.0
            } else {
                0.78
            };
            let grout = near_line(p[0], 1.0, 0.025) || near_line(p[2], 1.0, 0.025);
            let c = scale(PALETTES[region].floor, checker);
            (if grout { scale(c, 0.5) } else { c }, [0.0, -1.0, 0.0])
        }
        Surface::Ceiling => {
            let region = region_at(scene, p);
            let (lx, lz) = ((p[0] - 0.5).rem_euclid(2.0), (p[2] - 0.5).rem_euclid(2.0));
            let lamp = lx > 0.7 && lx < 1.3 && lz > 0.7 && lz < 1.3;
            let c = if lamp {
                [1.0, 0.98, 0.9]
            } else if near_line(p[0], 1.0, 0.02) || near_line(p[2], 1.0, 0.02) {
                scale(PALETTES[region].ceiling, 0.7)
            } else {
                PALETTES[region].ceiling
            };
            // Lit from below by the room: the ceiling is not in the light's shade.
            (c, [0.0, 0.0, 0.0])
        }
        Surface::Wall { face, region } => {
            let pal = &PALETTES[region as usize];
            let along = if face < 2 { p[2] } else { p[0] };
            let h = FLOOR_Y - p[1];
            let mut c = wall_pattern(pal.pattern, pal.walls[face], along, h);
            if h < 0.12 {
                c = scale(pal.walls[face], 0.3);
            } else if h > FLOOR_Y - CEILING_Y - 0.1 {
                c = scale(pal.walls[face], 1.15);
            }
            (c, NORMALS[face])
        }
        Surface::Pillar { face } => {
            let along = if face < 2 { p[2] } else { p[0] };
            let flute = near_line(along, 0.1, 0.015);
            let c = if flute {
                [0.55, 0.55, 0.52]
            } else {
                [0.88, 0.87, 0.82]
            };
            (c, NORMALS[face])
        }
        Surface::Crate { face } => {
            let (a, b) = match face {
                0 | 1 => (p[2], FLOOR_Y - p[1]),
                2 | 3 => (p[0], FLOOR_Y - p[1]),
                _ => (p[0], p[2]),
            };
            let (a, b) = (
                a - a.floor() - 0.12,
                if face == 4 { b - b.floor() - 0.12 } else { b },
            );
            let size = 0.76;
            let frame = !(0.07..=size - 0.07).contains(&a)
                || !(0.07..=FLOOR_Y - CRATE_TOP_Y - 0.07).contains(&b);
            let frame = frame || (face == 4 && b > size - 0.07);
            let diagonal = face < 4 && ((a - b).abs() < 0.05);
            let wood = [0.62, 0.43, 0.22];
            let c = if frame || diagonal {
                scale(wood, 0.65)
            } else {
                wood
            };
            (c, NORMALS[face])
        }
    }
}

/// The region of the cell under world point `p`.
fn region_at(scene: &Scene, p: [f64; 3]) -> usize {
    scene.region(p[2].floor() as i64, p[0].floor() as i64) as usize
}

/// A wall's texture at `along` metres along it and `h` above the floor.
fn wall_pattern(pattern: Pattern, base: Rgb, along: f64, h: f64) -> Rgb {
    match pattern {
        Pattern::Bricks => {
            let row = (h / 0.25).floor();
            let shift = if row as i64 % 2 == 0 { 0.0 } else { 0.25 };
            let x = along + shift;
            if near_line(h, 0.25, 0.02) || near_line(x, 0.5, 0.02) {
                return scale(base, 0.55);
            }
            let tint = 0.88 + 0.2 * hash((x / 0.5).floor() as i64, row as i64, 1);
            scale(base, tint)
        }
        Pattern::Planks => {
            if near_line(along, 0.3, 0.015) {
                return scale(base, 0.5);
            }
            let k = (along / 0.3).floor() as i64;
            let tint = 0.85 + 0.2 * hash(k, 0, 2) + 0.05 * (h * 9.0 + k as f64).sin();
            scale(base, tint)
        }
        Pattern::Panels => {
            if near_line(along, 1.0, 0.03) || near_line(h, 1.25, 0.03) {
                return scale(base, 0.5);
            }
            if (0.9..1.05).contains(&h) {
                return scale(base, 0.7);
            }
            base
        }
    }
}
