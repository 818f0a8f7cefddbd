using Microsoft.EntityFrameworkCore;

namespace ParcelTracker.OutsideWorld;

/// <summary>One pickup slot booked (and charged) by the carrier stand-in.</summary>
public sealed class CarrierReservation
{
    public long Id { get; set; }
    public Guid ParcelId { get; set; }
    public string Slot { get; set; } = "";

    /// <summary>The idempotency key of the call that booked it (a key-honouring carrier books once per key).</summary>
    public Guid IdempotencyKey { get; set; }

    /// <summary>Calls that reached the carrier for this booking: more than 1 means a repeated call the carrier deduplicated.</summary>
    public int Calls { get; set; }

    public DateTime ReceivedAt { get; set; }
}

/// <summary>One SMS sent by the notification stand-in.</summary>
public sealed class NotificationSent
{
    public long Id { get; set; }
    public Guid ParcelId { get; set; }
    public string Text { get; set; } = "";

    /// <summary>The idempotency key of the call that sent it (a key-honouring gateway sends once per key).</summary>
    public Guid IdempotencyKey { get; set; }

    /// <summary>Calls that reached the gateway for this SMS: more than 1 means a repeated call the gateway deduplicated.</summary>
    public int Calls { get; set; }

    public DateTime ReceivedAt { get; set; }
}

/// <summary>
/// What the outside world saw: the stand-ins' own records, written on their own connection and outside any
/// consumer transaction — a rolled-back consumer cannot take back a call that was made. On SQLite it is a separate
/// database file (a second writer on the application's file would wait on the consumer's own write lock).
/// </summary>
public sealed class OutsideWorldDbContext(DbContextOptions<OutsideWorldDbContext> options) : DbContext(options)
{
    public DbSet<CarrierReservation> CarrierReservations => Set<CarrierReservation>();
    public DbSet<NotificationSent> NotificationsSent => Set<NotificationSent>();

    protected override void OnModelCreating(ModelBuilder modelBuilder)
    {
        modelBuilder.Entity<CarrierReservation>(e =>
        {
            e.ToTable("carrier_reservations");
            e.Property(x => x.Id).HasColumnName("id");
            e.Property(x => x.ParcelId).HasColumnName("parcel_id");
            e.Property(x => x.Slot).HasColumnName("slot").HasMaxLength(64);
            e.Property(x => x.IdempotencyKey).HasColumnName("idempotency_key");
            e.Property(x => x.Calls).HasColumnName("calls");
            e.Property(x => x.ReceivedAt).HasColumnName("received_at");
            e.HasIndex(x => x.ParcelId);
            e.HasIndex(x => x.IdempotencyKey);
        });
        modelBuilder.Entity<NotificationSent>(e =>
        {
            e.ToTable("notifications_sent");
            e.Property(x => x.Id).HasColumnName("id");
            e.Property(x => x.ParcelId).HasColumnName("parcel_id");
            e.Property(x => x.Text).HasColumnName("text").HasMaxLength(500);
            e.Property(x => x.IdempotencyKey).HasColumnName("idempotency_key");
            e.Property(x => x.Calls).HasColumnName("calls");
            e.Property(x => x.ReceivedAt).HasColumnName("received_at");
            e.HasIndex(x => x.ParcelId);
            e.HasIndex(x => x.IdempotencyKey);
        });
    }
}
