//! The fixed scene: a grid of 1 m cells (rooms, corridors, walls, pillars, crates) between a flat
//! floor and ceiling, in the rig's world frame (OpenCV: y down, the eye at y = 0).

use crate::camera::Pose;

/// Eye to floor (world y of the floor, metres; y points down).
pub const FLOOR_Y: f64 = 1.2;
/// World y of the ceiling (1.3 m above the eye).
pub const CEILING_Y: f64 = -1.3;
/// World y of a crate's top (0.75 m above the floor).
pub const CRATE_TOP_Y: f64 = 0.45;

/// The map, one character per 1 m cell: row `r` spans `z ∈ [r, r + 1)`, column `c` spans
/// `x ∈ [c, c + 1)`. `#` wall, digits the floor of region N (rooms 1–5, 7 corridors), `P` a pillar
/// and `X` a crate standing in the region around them.
const MAP: [&str; 26] = [
    "########################",
    "#11111111##222222222222#",
    "#11111111##222222222222#",
    "#111X1111##2222P2222P22#",
    "#11111111772222222222X2#",
    "#1111111177222222222222#",
    "#11P11111##222222222222#",
    "#11111111##222222222222#",
    "#11111111##222222222222#",
    "####77########77########",
    "####77########77########",
    "#333333333333##44444444#",
    "#333333333333##44444444#",
    "#333P3333X333774444X444#",
    "#33333333333377444444P4#",
    "#333333333333##44444444#",
    "#33X33333P333##44444444#",
    "#333333333333##44444444#",
    "#######77##########77###",
    "#######77##########77###",
    "#55555555555555555555###",
    "#55555555555555555555###",
    "#555P55555X55555P5555###",
    "#55555555555555555555###",
    "#5555X5555555555555X5###",
    "########################",
];

/// What a cell holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cell {
    Floor,
    Wall,
    Pillar,
    Crate,
}

/// An axis-aligned solid: `[x0, y0, z0]`–`[x1, y1, z1]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Solid {
    pub lo: [f64; 3],
    pub hi: [f64; 3],
}

/// The grid and the region of every cell (walls take the region of a neighbouring floor, so a
/// wall is painted by the room it faces).
#[derive(Clone, Debug)]
pub struct Scene {
    pub rows: usize,
    pub cols: usize,
    cells: Vec<Cell>,
    regions: Vec<u8>,
}

impl Default for Scene {
    fn default() -> Self {
        Self::new()
    }
}

impl Scene {
    pub fn new() -> Self {
        let rows = MAP.len();
        let cols = MAP.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut cells = vec![Cell::Wall; rows * cols];
        let mut regions = vec![0u8; rows * cols];
        for (r, line) in MAP.iter().enumerate() {
            for (c, ch) in line.bytes().enumerate() {
                cells[r * cols + c] = match ch {
                    b'P' => Cell::Pillar,
                    b'X' => Cell::Crate,
                    b'0'..=b'9' => Cell::Floor,
                    _ => Cell::Wall,
                };
                if ch.is_ascii_digit() {
                    regions[r * cols + c] = ch - b'0';
                }
            }
        }
        // Non-floor cells take a neighbour's region (twice, so crates next to pillars get one).
        for _ in 0..2 {
            for r in 0..rows {
                for c in 0..cols {
                    if regions[r * cols + c] != 0 {
                        continue;
                    }
                    let near = [(0, 1), (2, 1), (1, 0), (1, 2)]
                        .iter()
                        .filter_map(|&(dr, dc)| {
                            let (rr, cc) = ((r + dr).checked_sub(1)?, (c + dc).checked_sub(1)?);
                            (rr < rows && cc < cols).then(|| regions[rr * cols + cc])
                        })
                        .find(|&g| g != 0);
                    if let Some(g) = near {
                        regions[r * cols + c] = g;
                    }
                }
            }
        }
        Scene {
            rows,
            cols,
            cells,
            regions,
        }
    }

    /// The cell at `(row, col)`; outside the map is wall.
    pub fn cell(&self, row: i64, col: i64) -> Cell {
        if row < 0 || col < 0 || row as usize >= self.rows || col as usize >= self.cols {
            return Cell::Wall;
        }
        self.cells[row as usize * self.cols + col as usize]
    }

    /// The region (1–7) of cell `(row, col)`; 0 outside.
    pub fn region(&self, row: i64, col: i64) -> u8 {
        if row < 0 || col < 0 || row as usize >= self.rows || col as usize >= self.cols {
            return 0;
        }
        self.regions[row as usize * self.cols + col as usize]
    }

    /// The solid in cell `(row, col)`, if any.
    pub fn solid(&self, row: i64, col: i64) -> Option<Solid> {
        let (x, z) = (col as f64, row as f64);
        let inset = |m: f64, top: f64| Solid {
            lo: [x + m, top, z + m],
            hi: [x + 1.0 - m, FLOOR_Y, z + 1.0 - m],
        };
        match self.cell(row, col) {
            Cell::Floor => None,
            // Walls reach past the floor and ceiling planes, so only their sides are ever hit.
            Cell::Wall => Some(Solid {
                lo: [x, CEILING_Y - 1.0, z],
                hi: [x + 1.0, FLOOR_Y + 1.0, z + 1.0],
            }),
            Cell::Pillar => Some(inset(0.3, CEILING_Y - 1.0)),
            Cell::Crate => Some(inset(0.12, CRATE_TOP_Y)),
        }
    }

    /// Whether a body of `radius` metres at world `(x, z)` touches no solid.
    pub fn is_free(&self, x: f64, z: f64, radius: f64) -> bool {
        let (r0, r1) = ((z - radius).floor() as i64, (z + radius).floor() as i64);
        let (c0, c1) = ((x - radius).floor() as i64, (x + radius).floor() as i64);
        for row in r0..=r1 {
            for col in c0..=c1 {
                if let Some(s) = self.solid(row, col) {
                    let dx = (s.lo[0] - x).max(x - s.hi[0]).max(0.0);
                    let dz = (s.lo[2] - z).max(z - s.hi[2]).max(0.0);
                    if dx * dx + dz * dz < radius * radius {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// How far (metres, up to `max`, in 0.1 m steps) a body can walk from `(x, z)` facing `yaw`.
    pub fn clearance(&self, x: f64, z: f64, yaw: f64, max: f64) -> f64 {
        let (s, c) = yaw.sin_cos();
        let mut d = 0.0;
        while d < max && self.is_free(x + s * (d + 0.1), z + c * (d + 0.1), 0.3) {
            d += 0.1;
        }
        d
    }

    /// Centres of the floor cells whose whole neighbourhood is free (spawn candidates).
    pub fn open_cells(&self, radius: f64) -> Vec<(f64, f64)> {
        let mut out = Vec::new();
        for row in 0..self.rows as i64 {
            for col in 0..self.cols as i64 {
                let (x, z) = (col as f64 + 0.5, row as f64 + 0.5);
                if self.cell(row, col) == Cell::Floor && self.is_free(x, z, radius) {
                    out.push((x, z));
                }
            }
        }
        out
    }

    /// Where the engine's session starts (its rig's origin): room 1, facing +z down the room.
    pub fn spawn(&self) -> Pose {
        Pose::level([5.5, 0.0, 1.6], 0.0)
    }
}
