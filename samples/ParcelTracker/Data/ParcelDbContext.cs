using Microsoft.EntityFrameworkCore;
using ParcelTracker.Domain;

namespace ParcelTracker.Data;

/// <summary>The application's own DbContext: its data, and the ExactlyOnce inbox and outbox beside it.</summary>
public sealed class ParcelDbContext(DbContextOptions<ParcelDbContext> options) : DbContext(options)
{
    public DbSet<Parcel> Parcels => Set<Parcel>();

    protected override void OnModelCreating(ModelBuilder modelBuilder)
    {
        modelBuilder.Entity<Parcel>(e =>
        {
            e.ToTable("parcels");
            e.HasKey(p => p.Id);
            e.Property(p => p.Id).HasColumnName("id");
            e.Property(p => p.TrackingNumber).HasColumnName("tracking_number").HasMaxLength(32).IsRequired();
            e.Property(p => p.Destination).HasColumnName("destination").HasMaxLength(200).IsRequired();
            e.Property(p => p.CreatedAt).HasColumnName("created_at");
            e.Property(p => p.PickupSlot).HasColumnName("pickup_slot").HasMaxLength(64);
            e.Property(p => p.NotifiedAt).HasColumnName("notified_at");
            e.HasIndex(p => p.TrackingNumber).IsUnique();
        });
        modelBuilder.AddExactlyOnce(); // inbox_messages + outbox_messages (+ after-commit actions) + recorded_steps, beside the parcels
    }
}
